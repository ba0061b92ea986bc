"""What a stale pid file, a hostile manifest or a broken input does to the harness (no servers)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from kvscope.deploy import servers


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_stale_pid_file_never_signals_the_process_that_now_has_its_pid(tmp_path):
    pid_file = tmp_path / "server.pid"
    lookalike = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", servers.SERVER_COMMAND])
    try:
        pid_file.write_text(f"{lookalike.pid}\n")  # an older kvscope's pid file: the pid alone
        assert servers.started(pid_file) == lookalike.pid
        os.utime(pid_file, (0, 0))  # written before this process started: its pid was given to someone else
        assert servers.started(pid_file) is None
    finally:
        lookalike.kill()
        lookalike.wait()
    bystander = subprocess.Popen(["setsid", "sleep", "120"])  # a session leader, as a server would be
    pid, port = bystander.pid, free_port()
    start = servers.stamp(pid).split()[1]
    try:
        for stale in (f"{pid}", f"{pid} 1 {servers.boot_id()}", f"{pid} {start} another-boot",
                      servers.stamp(pid)):  # the last: this very process, but not a vLLM server
            pid_file.write_text(stale)
            assert "not signalled" in servers.stop(pid_file, grace_s=1), stale
            assert servers.alive(pid) and not pid_file.exists()
        for stale in (f"{pid}", f"{pid} 1 {servers.boot_id()}"):
            pid_file.write_text(stale)
            assert servers.probe(pid_file, port)[0] == servers.NOT_RUNNING
        pid_file.write_text(servers.stamp(pid))
        assert servers.started(pid_file) == pid
    finally:
        bystander.kill()
        bystander.wait()


def test_secrets_in_server_arguments_and_environments_are_redacted_before_anything_is_written():
    from kvscope import auth

    args = ["--model", "m", "--hf-token", "hf_abc", "--max-num-batched-tokens", "512", "--enable-auth", "--seed", "0",
            "--kv-transfer-config", '{"kv_connector_extra_config": {"s3_secret_key": "zz", "url": '
            '"redis://kv:hunter2@cache:6379", "nested": [{"password": "p"}], "ram_bytes": 1}}',
            "--custom-histogram-buckets", '{"ttft": [0.1, 0.2]}']
    out = auth.redact_args(args)
    assert out[3] == auth.REDACTED and out[5] == "512" and out[7:9] == ["--seed", "0"]
    assert not any(s in " ".join(out) for s in ("hf_abc", "zz", "hunter2", '"p"'))
    assert '"ram_bytes": 1' in out[10] and out[12] == '{"ttft": [0.1, 0.2]}'  # the rest as it was
    env = auth.redact_env({"HF_TOKEN": "x", "VLLM_API_KEY": "k", "MYAPIKEY": "k", "VLLM_CPU_OMP_THREADS_BIND": "nobind"})
    assert env == {"HF_TOKEN": auth.REDACTED, "VLLM_API_KEY": auth.REDACTED, "MYAPIKEY": auth.REDACTED,
                   "VLLM_CPU_OMP_THREADS_BIND": "nobind"}


def test_the_api_key_comes_from_the_environment_or_a_file(tmp_path, monkeypatch):
    from kvscope import auth

    monkeypatch.delenv(auth.KEY_ENV, raising=False)
    monkeypatch.delenv(auth.KEY_FILE_ENV, raising=False)
    assert auth.api_key() is None and "Authorization" not in auth.headers()
    monkeypatch.setenv(auth.KEY_ENV, "sk-env")
    assert auth.headers()["Authorization"] == "Bearer sk-env"
    (tmp_path / "key").write_text("sk-file\n")
    monkeypatch.setenv(auth.KEY_FILE_ENV, str(tmp_path / "key"))
    assert auth.api_key() == "sk-file"


def test_the_nfs_export_squashes_every_client_to_a_dedicated_user_of_a_0700_folder(tmp_path):
    from conftest import PLAYBOOK, REPO

    (tmp_path / "hosts.yml").write_text(
        "all:\n  children:\n    nfs_server:\n      hosts:\n        localhost:\n"
        "          ansible_connection: local\n          ansible_python_interpreter: '{{ ansible_playbook_python }}'\n")
    (tmp_path / "play.yml").write_text(
        "- hosts: nfs_server\n  gather_facts: false\n  roles:\n    - role: nfs\n"
        f"      vars: {{nfs_export_path: {tmp_path}/export, kvscope_run_dir: {tmp_path}/run}}\n")
    (tmp_path / "export").mkdir(mode=0o755)  # so --check --diff shows what the role makes of its modes
    env = {**os.environ, "ANSIBLE_ROLES_PATH": str(REPO / "ansible" / "roles"), "ANSIBLE_NOCOLOR": "1"}
    out = subprocess.run([str(PLAYBOOK), "-i", str(tmp_path / "hosts.yml"), str(tmp_path / "play.yml"), "--check",
                          "--diff"], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:]
    export = next(line for line in out.stdout.splitlines() if line.startswith(f"+{tmp_path}/export "))
    assert "all_squash,anonuid=64077,anongid=64077" in export and "no_root_squash" not in export
    assert '+    "mode": "0700",' in out.stdout and '+    "owner": 64077,' in out.stdout
    assert "0777" not in out.stdout


def test_report_html_shows_hostile_text_from_a_run_folder_as_text_and_forbids_scripts(tmp_path):
    from test_report import four, make_run

    from kvscope.analyze import report

    run = make_run(tmp_path / "run", four(), apc={"failed": [0]})
    hostile = "<script>alert(1)</script><img src=x onerror=alert(2)>"
    records = run / "records" / "apc__s.jsonl"
    records.write_text(records.read_text().replace("HTTP 500", hostile))  # a failed request's error, edited
    doc = json.loads((run / "run.json").read_text())
    doc["command"] = hostile
    doc["servers"][2]["vllm_version"] = hostile
    (run / "run.json").write_text(json.dumps(doc))
    report.write(run, min_hits=1)
    page = (run / "report.html").read_text()
    assert "<script" not in page and "<img src=x" not in page
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page  # shown, as text
    assert "<details><summary>Server flags per config</summary>" in page and page.count("<img ") == 4
    assert "Content-Security-Policy" in page and "default-src 'none'" in page


@pytest.mark.parametrize("flag, value", [
    ("--enable-prefix", True),  # vLLM's parser takes an unambiguous prefix for the option
    ("--enable_prefix_caching", True),  # and '_' for '-'
    ("--kv-offloading_size", 4),
    ("--api-ke", "sk-1"),
    ("--api_key", "sk-1"),
    ("--kv-transfer-config.kv_connector", "ExampleConnector"),  # a key of the option's JSON
    ("--config", "serve.yaml"),  # a file of flags kvscope cannot see
    ("--no_enable_prefix_caching", False),  # the same flag twice, once spelt with '_'
])
def test_flags_are_checked_as_vllms_parser_reads_them(tmp_path, flag, value):
    import yaml
    from test_matrix import SHIPPED, cfg, write

    from kvscope.config import matrix

    doc = yaml.safe_load(SHIPPED.read_text())
    cfg(doc, "baseline")["flags"][flag] = value
    with pytest.raises(matrix.ConfigError, match="config 'baseline': field '"):
        matrix.load(write(tmp_path, doc))


def test_overrides_are_checked_as_vllms_parser_reads_them(tmp_path):
    from test_matrix import SHIPPED

    from kvscope.config import matrix
    from kvscope.config.render import parse_overrides, render

    for bad in ('{"api_key": "sk-1"}', '{"api-ke": "sk-1"}', '{"kv_transfer_config": "{}"}'):
        with pytest.raises(matrix.ConfigError, match="flag overrides"):
            parse_overrides(bad)
    m = matrix.load(SHIPPED)
    for on in ('{"enable_prefix_caching": true}', '{"no_enable_prefix_caching": false}'):
        with pytest.raises(matrix.ConfigError, match="would give the golden server a cache"):
            render(m, m.get("baseline"), "cpu", tmp_path, tmp_path / "stores", "127.0.0.1", parse_overrides(on))
    args = render(m, m.get("apc"), "cpu", tmp_path, tmp_path / "stores", "127.0.0.1",
                  parse_overrides('{"enforce_eager": false, "max_model_len": 1024}')).server_args
    assert "--enforce-eager" not in args and "--max-model-len=1024" in args


def test_abbreviated_and_dotted_secret_flags_are_redacted():
    from kvscope import auth

    out = auth.redact_args(["--hf-tok", "hf_abc", "--kv-transfer-config.kv_connector_extra_config.password", "pw",
                            "--api_ke=sk-1", "--dp-supervisor-probe-timeout-s", "5"])
    assert out == ["--hf-tok", auth.REDACTED, "--kv-transfer-config.kv_connector_extra_config.password", auth.REDACTED,
                   "--api_ke=" + auth.REDACTED, "--dp-supervisor-probe-timeout-s", "5"]


def test_the_recorded_command_keeps_no_secret(tmp_path, monkeypatch):
    from kvscope import auth, cli

    monkeypatch.setenv(auth.KEY_ENV, "sk-live-0123")
    monkeypatch.setenv("KVSCOPE_COMMAND", "make bench KVSCOPE_API_KEY=sk-live-0123 KVSCOPE_STORE_KEY='a b c d e f g h i' "
                                          "USERS=4 NOTE=sk-live-0123")
    recorded = cli.bench_options(cli.build_parser().parse_args(["bench", "--run-id", "r"])).command  # run.json's
    assert recorded == (f"make bench KVSCOPE_API_KEY={auth.REDACTED} KVSCOPE_STORE_KEY={auth.REDACTED} USERS=4 "
                        f"NOTE={auth.REDACTED}")
    command = "kvscope bench --endpoint a=http://user:pw1@h:8000 --golden http://:pw2@h:8001 --api-key=k3 --token k4"
    assert auth.redact_command(command) == (f"kvscope bench --endpoint a=http://user:{auth.REDACTED}@h:8000 --golden "
                                            f"http://:{auth.REDACTED}@h:8001 --api-key={auth.REDACTED} --token "
                                            f"{auth.REDACTED}")


def test_the_redactor_finds_url_passwords_secret_values_of_any_type_and_more_secret_names(monkeypatch):
    from kvscope import auth

    monkeypatch.setenv(auth.KEY_ENV, "sk-live-0123")
    monkeypatch.setenv("PWD", "/home/me/kvscope")  # the shell's folder: not a secret, though 'pwd' names one
    assert auth.redact_command("make -C /home/me/kvscope bench") == "make -C /home/me/kvscope bench"
    extra = {"remote_url": "redis://:pw1@cache:6379", "password": 12345, "auth": {"user": "u", "pin": "p2"},
             "ram_bytes": 1}
    out = auth.redact_args(["--kv-transfer-config", json.dumps({"kv_connector_extra_config": extra}),
                            "--url", "redis://u:pw3@cache", "--note", "sk-live-0123"])
    assert not any(s in " ".join(out) for s in ("pw1", "12345", "p2", "pw3", "sk-live")), out
    assert '"ram_bytes": 1' in out[1]
    env = auth.redact_env({"PGPASS": "a", "DB_PWD": "b", "pass": "c", "BEARER": "d", "CACHE_URL": "redis://u:pw4@h",
                           "NOTE": "key sk-live-0123", "VLLM_CPU_OMP_THREADS_BIND": "nobind"})
    assert env == {"PGPASS": auth.REDACTED, "DB_PWD": auth.REDACTED, "pass": auth.REDACTED, "BEARER": auth.REDACTED,
                   "CACHE_URL": f"redis://u:{auth.REDACTED}@h", "NOTE": f"key {auth.REDACTED}",
                   "VLLM_CPU_OMP_THREADS_BIND": "nobind"}


def test_deployed_store_folders_are_private_under_either_runtime():
    import yaml
    from conftest import REPO

    for runtime in ("process", "container"):
        tasks = yaml.safe_load((REPO / "ansible" / "roles" / "vllm" / "tasks" / f"{runtime}.yml").read_text())
        made = [t["ansible.builtin.file"]["mode"] for t in tasks
                if "stores" in str(t.get("loop", "")) and "ansible.builtin.file" in t]
        assert made == ["0700"], runtime


def _matrix_text(doc, extra_config_line: str = "") -> str:
    import yaml

    text = yaml.safe_dump(doc, sort_keys=False)
    return text.replace("      fs_path: '{store:blocks}'\n", f"      fs_path: '{{store:blocks}}'\n{extra_config_line}", 1)


def test_the_matrix_refuses_an_alias_bomb_quickly(tmp_path):
    import time

    import yaml
    from test_matrix import SHIPPED

    from kvscope.config import matrix

    levels = [f"l0: &l0 [{', '.join(['x'] * 10)}]"] + [
        f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 10)}]" for i in range(1, 7)]  # 10^7 strings once expanded
    path = tmp_path / "bomb.yaml"
    path.write_text(_matrix_text(yaml.safe_load(SHIPPED.read_text()), f"      bomb: {{{', '.join(levels)}}}\n"))
    assert len(path.read_bytes()) < 20_000 and "bomb: {l0: &l0" in path.read_text()
    started = time.monotonic()
    with pytest.raises(matrix.ConfigError, match=f"{path}: cannot read the matrix: .*aliases"):
        matrix.load(path)
    assert time.monotonic() - started < 5
    assert matrix.load(SHIPPED).get("ucm-blend").flags  # the shipped matrix's own aliases still read


@pytest.mark.parametrize("twice", ["configs", "port"])
def test_the_matrix_refuses_a_key_given_twice(tmp_path, twice):
    import yaml
    from test_matrix import SHIPPED

    from kvscope.config import matrix

    text = _matrix_text(yaml.safe_load(SHIPPED.read_text()))
    text = text + "configs: []\n" if twice == "configs" else text.replace("  port: 8100\n", "  port: 8100\n  port: 8199\n")
    (tmp_path / "m.yaml").write_text(text)
    with pytest.raises(matrix.ConfigError, match=f"key '{twice}' .*twice"):
        matrix.load(tmp_path / "m.yaml")


def test_a_scenarios_file_refuses_a_key_given_twice(tmp_path):
    from kvscope.config.matrix import ConfigError
    from kvscope.run.workload import load_scenarios

    (tmp_path / "s.yaml").write_text("scenarios:\n  - {name: a, kind: rag, num_queries: 8, num_queries: 800}\n")
    with pytest.raises(ConfigError, match="s.yaml: cannot read the scenarios: .*key 'num_queries' is given twice"):
        load_scenarios(tmp_path / "s.yaml")


@pytest.mark.parametrize("run_id", ["../escape", "/tmp/abs", "a/b/c", "two words", ".hidden", ""])
def test_a_run_id_that_is_not_a_plain_folder_name_is_refused_before_anything_runs(tmp_path, monkeypatch, capsys,
                                                                                   run_id):
    from kvscope import cli
    from kvscope.run import treatments

    monkeypatch.setattr(treatments, "run", lambda plan: tmp_path)
    assert cli.main(["bench", "--run-id", run_id]) == 2
    assert cli.main(["bench", "--run-id", run_id, "--plan"]) == 2
    assert "--run-id" in capsys.readouterr().err


@pytest.mark.parametrize("target, variable", [
    ("validate", "MATRIX"), ("validate", "CONFIGS"), ("report", "RUN"), ("report", "SLO"), ("compare", "RUNS"),
    ("compare", "OUT"), ("bench", "RUN_ID"), ("bench", "USERS"), ("bench", "SCENARIOS"), ("bench", "REPEATS"),
    ("bench", "SLO"), ("bench", "CONFIGS"), ("deploy", "CONFIGS"), ("deploy", "MATRIX"), ("deploy", "MODEL"),
    ("deploy", "INVENTORY")])
def test_make_hands_a_users_values_to_the_tools_as_arguments_never_as_shell_code(tmp_path, target, variable):
    from test_makefile import dry_run

    venv, marker = tmp_path / "venv", tmp_path / "ran"
    (venv / "bin").mkdir(parents=True)
    for tool in ("python", "ansible-playbook"):  # stand-ins that print the arguments they are given
        (venv / "bin" / tool).write_text("#!/bin/sh\nprintf '[%s]' \"$@\"\n")
        (venv / "bin" / tool).chmod(0o755)
    for value in (f"x; touch {marker}", f"x'; touch {marker}; '", f"$(touch {marker})", f"`touch {marker}`"):
        lines = dry_run(target, f"{variable}={value}", f"VENV={venv}").replace("\\\n", "").splitlines()
        commands = [x for x in lines if f"{venv}/bin/ansible-playbook" in x
                    or f"{venv}/bin/python -m kvscope.cli" in x and "build-model" not in x]
        assert commands
        for command in commands:
            subprocess.run(["bash", "-c", command], cwd=tmp_path, capture_output=True, timeout=60)
            assert not marker.exists(), (value, command)


def test_host_environment_names_that_are_not_plain_variable_names_are_refused(tmp_path):
    from conftest import PLAYBOOK, REPO

    (tmp_path / "hosts.yml").write_text(
        "all:\n  hosts:\n    localhost:\n      ansible_connection: local\n"
        "      ansible_python_interpreter: '{{ ansible_playbook_python }}'\n")
    (tmp_path / "play.yml").write_text(
        "- hosts: all\n  gather_facts: false\n  roles:\n    - role: vllm\n      vars:\n"
        "        kvscope_harness_python: /bin/false\n        kvscope_matrix: /nonexistent\n"
        f"        kvscope_model_dir: /nonexistent\n        kvscope_platform: cpu\n        kvscope_run_dir: {tmp_path}\n"
        "        kvscope_runtime: process\n        vllm_host_env: {'X=1; touch /tmp/pwned; Y': '1'}\n")
    env = {**os.environ, "ANSIBLE_ROLES_PATH": str(REPO / "ansible" / "roles"), "ANSIBLE_NOCOLOR": "1"}
    out = subprocess.run([str(PLAYBOOK), "-i", str(tmp_path / "hosts.yml"), str(tmp_path / "play.yml")], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode != 0 and "not plain variable names" in out.stdout, out.stdout[-3000:]


def test_a_report_on_a_run_whose_every_request_was_refused_is_written_and_inconclusive(tmp_path):
    from test_report import four, make_run

    from kvscope import cli

    refused = {"failed": [0, 1]}
    run = make_run(tmp_path / "run", four(), baseline=refused, control=refused, apc=refused, canary_shift=refused)
    assert cli.main(["report", str(run)]) == 3
    assert "| apc | candidate | **INCOMPLETE** (unexpected) | 2 of 2 requests failed" in (run / "report.md").read_text()


def test_bench_without_report_against_dead_servers_says_so_and_exits_inconclusive(tmp_path, model_dir, capsys):
    from kvscope import cli

    servers = [{"config": config, "role": role, "port": free_port(), "platform": "cpu", "vllm_version": "0.32.0",
                "served_model_name": "tiny-qwen3", "server_args": [], "kv_capacity_tokens": 4096, "block_size": 64,
                "prefix_caching": role == "candidate", "model_path": str(model_dir), "model_hash": "f" * 64}
               for config, role in (("baseline", "golden"), ("apc", "candidate"))]  # nothing listens on their ports
    (tmp_path / "deployment.json").write_text(json.dumps({"servers": servers}))
    (tmp_path / "s.yaml").write_text("scenarios:\n  - {name: repeat-867, kind: repeat, repeats: 2, max_tokens: 4}\n")
    code = cli.main(["bench", "--deployment", str(tmp_path / "deployment.json"), "--results", str(tmp_path),
                     "--scenarios-file", str(tmp_path / "s.yaml"), "--scenarios", "repeat-867", "--run-id", "dead",
                     "--timeout-s", "60"])
    assert code == 3 and "no answer at all: baseline x repeat-867, apc x repeat-867" in capsys.readouterr().err


def _certificates(folder):
    """A CA, and a certificate it signed for localhost (PEM files): (ca, certificate, key)."""
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.UTC)

    def cert(subject, issuer, key, signer, ca):
        builder = (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer).public_key(key.public_key())
                   .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(hours=1))
                   .not_valid_after(now + datetime.timedelta(days=1))
                   .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
        if not ca:
            builder = builder.add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost")]), critical=False)
        return builder.sign(signer, hashes.SHA256())

    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kvscope test CA")])
    ca = cert(ca_name, ca_name, ca_key, ca_key, True)
    leaf = cert(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")]), ca_name, key, ca_key, False)
    paths = folder / "ca.pem", folder / "cert.pem", folder / "key.pem"
    paths[0].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths[1].write_bytes(leaf.public_bytes(serialization.Encoding.PEM))
    paths[2].write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return paths


def _https_api(cert, key):
    """An OpenAI-compatible server's read-only routes over TLS, in a thread; returns the server."""
    import http.server
    import ssl
    import threading

    class Api(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = {"/v1/models": b'{"data": [{"id": "tiny", "max_model_len": 4096}]}', "/version": b'{"version": "x"}',
                    "/metrics": b""}.get(self.path)
            self.send_response(200 if body is not None else 404)
            self.end_headers()
            self.wfile.write(body or b"")

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Api)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def test_https_endpoints_are_checked_against_the_systems_cas_or_a_ca_file(tmp_path, monkeypatch, model_dir):
    from kvscope import cli
    from kvscope.config.matrix import ConfigError
    from kvscope.run import endpoints, treatments

    ca, cert, key = _certificates(tmp_path)
    server = _https_api(cert, key)
    url = f"https://localhost:{server.server_address[1]}"
    try:
        monkeypatch.delenv("SSL_CERT_FILE", raising=False)
        with pytest.raises(ConfigError, match="CERTIFICATE_VERIFY_FAILED"):  # not a CA of this system
            endpoints.treatments([url], url, None, model_dir)
        seen: dict = {}
        monkeypatch.setattr(treatments, "run", lambda plan: seen.update(plan=plan) or tmp_path)
        cli.main(["bench", "--endpoint", f"theirs={url}", "--golden", url, "--model-dir", str(model_dir), "--ca-file",
                  str(ca), "--results", str(tmp_path), "--scenarios", "repeat-867"])
        assert [(t.config, t.url, t.manifest.served_model_name) for t in seen["plan"].servers] == [
            ("golden", url, "tiny"), ("theirs", url, "tiny")]
    finally:
        server.shutdown()
    user = subprocess.run([sys.executable, "-c", "from kvscope.run.loaduser import KVScopeUser as U; print(U.insecure)"],
                          capture_output=True, text=True, timeout=120)
    assert user.stdout.strip() == "False", user.stderr[-2000:]  # Locust checks certificates too


def test_endpoint_urls_are_rebuilt_exactly_and_refused_with_their_name_before_anything_is_contacted(model_dir):
    from kvscope.artifacts import root_url
    from kvscope.config.matrix import ConfigError
    from kvscope.run import endpoints

    name, scheme, host, port = endpoints.parse("v6=http://[::1]:9", "endpoint-1")
    assert root_url(scheme, host, port) == "http://[::1]:9"
    assert endpoints.parse("https://gateway", "e")[1:] == ("https", "gateway", 443)
    for bad, why in (("http://h:99999", "endpoint 'http://h:99999': port"), ("http://h:1/?model=x", "query"),
                     ("http://u:pw@h:1", "credentials"), ("ftp://h:1", "http")):
        with pytest.raises(ConfigError, match=why):
            endpoints.parse(bad, "e")
    dead = f"http://127.0.0.1:{free_port()}"  # golden does not answer: the bad endpoint is named first
    with pytest.raises(ConfigError, match="endpoint 'ftp://h:1'"):
        endpoints.treatments(["ftp://h:1"], dead, None, model_dir)


def test_make_validate_checks_a_matrix_of_your_own_without_the_default_configs(tmp_path):
    import yaml
    from test_makefile import dry_run
    from test_matrix import SHIPPED

    doc = yaml.safe_load(SHIPPED.read_text())
    doc["configs"] = [c for c in doc["configs"] if c["name"] in ("baseline", "apc")]
    doc["configs"][1]["name"] = "team-tier"
    (tmp_path / "team.yaml").write_text(yaml.safe_dump(doc))
    line = next(x for x in dry_run("validate", f"MATRIX={tmp_path}/team.yaml").splitlines() if "kvscope.cli" in x)
    out = subprocess.run(["bash", "-c", line.replace(".venv/bin/python", sys.executable)], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0 and "2 configs valid: baseline, team-tier" in out.stdout, out.stderr
    assert "--configs 'baseline,apc'" in dry_run("validate", "CONFIGS=baseline,apc")
    assert "--configs" in dry_run("validate")  # the default selection, against the default matrix


def test_the_matrix_option_works_after_the_subcommand_too(tmp_path, capsys):
    from test_matrix import SHIPPED

    from kvscope import cli

    assert cli.main(["validate", "--matrix", str(SHIPPED)]) == 0
    assert f"{SHIPPED}: " in capsys.readouterr().out
    assert cli.main(["validate", "--matrix", str(tmp_path / "none.yaml")]) == 2


def test_the_matrix_option_goes_before_or_after_each_subcommand_that_reads_it(tmp_path):
    # validate took --matrix either side; rollout, which also reads the matrix, refused it after the subcommand
    from kvscope import cli

    parser = cli.build_parser()
    for command in (["validate"], ["rollout", "--inventory", "inv", "--configs", "kvscope-fs"]):
        before = parser.parse_args(["--matrix", "mine.yaml", *command])
        after = parser.parse_args([*command, "--matrix", "mine.yaml"])
        default = parser.parse_args(command)
        assert before.matrix == after.matrix == Path("mine.yaml") and default.matrix == cli.DEFAULT_MATRIX, command


@pytest.mark.parametrize("option", [["--min-hits", "-100"], ["--min-hits", "0"], ["--max-failed", "99"],
                                    ["--max-failed", "-0.5"]])
def test_gate_options_outside_their_range_are_refused(tmp_path, capsys, option):
    from kvscope import cli

    with pytest.raises(SystemExit) as exit_:
        cli.main(["report", str(tmp_path), *option])
    assert exit_.value.code == 2 and option[0] in capsys.readouterr().err


def test_a_matrix_whose_cached_servers_could_not_be_reset_is_refused(tmp_path):
    import yaml
    from test_matrix import SHIPPED, cfg, write

    from kvscope.config import matrix

    doc = yaml.safe_load(SHIPPED.read_text())
    del doc["platforms"]["cpu"]["env"]["VLLM_SERVER_DEV_MODE"]
    for name in ("baseline", "control"):  # cache-off: nothing to reset
        cfg(doc, name)["env"] = {"VLLM_SERVER_DEV_MODE": "1"}
    with pytest.raises(matrix.ConfigError, match="config 'apc': field 'env': VLLM_SERVER_DEV_MODE") as err:
        matrix.load(write(tmp_path, doc))
    assert "config 'baseline'" not in str(err.value)


# A run folder from someone else: links, FIFOs, bombs and lines cut short (issue 59)


def _hostile_run(tmp_path, **per_config):
    from test_report import four, make_run

    return make_run(tmp_path / "run", four(), **per_config)


def _victim(tmp_path) -> Path:
    victim = tmp_path / "authorized_keys"
    victim.write_text("ssh-ed25519 AAAA owner\n")
    return victim


def test_the_report_writes_through_no_link_of_a_run_folder_and_an_error_stays_on_one_line(tmp_path):
    from kvscope import cli

    run = _hostile_run(tmp_path, apc={"failed": [0]})
    records = run / "records" / "apc__s.jsonl"
    records.write_text(records.read_text().replace('"HTTP 500"', json.dumps("HTTP 500\nssh-ed25519 AAAA attacker\n")))
    victim = _victim(tmp_path)
    linked = ["report.md", "report.html", "summary.csv", "hit_rates.png"]
    for name in linked:
        (run / name).symlink_to(victim)
    assert cli.main(["report", str(run)]) == 3
    assert victim.read_text() == "ssh-ed25519 AAAA owner\n"
    assert all((run / name).is_file() and not (run / name).is_symlink() for name in linked)
    md = (run / "report.md").read_text()
    assert "HTTP 500" in md and not any(line.startswith("ssh-ed25519") for line in md.splitlines())


def test_run_json_is_replaced_whole_or_not_at_all(tmp_path):
    run = _hostile_run(tmp_path)
    before = (run / "run.json").read_bytes()
    # the interrupt path rewrites run.json; a disk that fills on the way (a file size limit here) keeps the old one
    code = ("import resource, sys; from pathlib import Path; from kvscope.run import treatments; "
            "resource.setrlimit(resource.RLIMIT_FSIZE, (int(sys.argv[2]), resource.RLIM_INFINITY)); "
            "treatments._set_interrupted(Path(sys.argv[1]), 'SIGTERM during x')")
    out = subprocess.run([sys.executable, "-c", code, str(run), str(len(before) // 2)], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 1 and "File too large" in out.stderr, out.stderr[-2000:]
    assert (run / "run.json").read_bytes() == before
    assert sorted(p.name for p in run.iterdir()) == ["records", "run.json", "status.jsonl", "workloads"]  # no temp


def test_a_last_line_cut_short_is_set_aside_and_counted_and_the_run_reads_and_resumes(tmp_path):
    from kvscope import cli
    from kvscope.artifacts import StatusRow, append_jsonl, read_jsonl
    from kvscope.run import treatments

    run = _hostile_run(tmp_path)
    records, status = run / "records" / "apc__s.jsonl", run / "status.jsonl"
    lines = records.read_text().splitlines(keepends=True)
    records.write_text(lines[0] + lines[1][:40])  # a full disk mid-write: half of the second record
    rows = status.read_text().splitlines(keepends=True)
    status.write_text("".join(rows[:-1]) + rows[-1][:20])  # and half of the last status row
    assert cli.main(["report", str(run), "--min-hits", "1"]) == 3
    md = (run / "report.md").read_text()
    assert "| apc | candidate | **INCOMPLETE** (unexpected) | s: 1 of 2 answers recorded" in md
    assert "`records/apc__s.jsonl`: its last line (40 bytes) has no newline" in md
    assert "`status.jsonl`: its last line (20 bytes) has no newline" in md
    # --resume reads which treatments finished, and appends its rows after the last whole line
    assert treatments._done(status) == {("baseline", "s"), ("control", "s"), ("apc", "s")}
    append_jsonl(status, [StatusRow(config="canary-shift", scenario="s")])
    assert [r.config for r in read_jsonl(status, StatusRow)] == ["baseline", "control", "apc", "canary-shift"]


def test_appends_to_a_run_folder_follow_no_link(tmp_path):
    from kvscope.artifacts import StatusRow, append_jsonl

    victim = _victim(tmp_path)
    (tmp_path / "status.jsonl").symlink_to(victim)
    with pytest.raises(ValueError, match=r"status\.jsonl: a symbolic link"):
        append_jsonl(tmp_path / "status.jsonl", [StatusRow(config="a", scenario="s")])
    assert victim.read_text() == "ssh-ed25519 AAAA owner\n"


def test_compress_again_on_records_in_both_forms_keeps_every_record(tmp_path):
    from kvscope import cli
    from kvscope.artifacts import ArtifactError, Record, read_jsonl
    from kvscope.runfolder import RunFolder

    run, rf = _hostile_run(tmp_path), RunFolder(tmp_path / "run")
    assert cli.main(["compress", str(run)]) == 0
    late = Record(config="apc", scenario="s", phase="measure", request_id="r2", session_id="r2", turn=0,
                  endpoint="chat", start_unix_s=2.0)
    (run / "records" / "apc__s.jsonl").write_text(late.model_dump_json() + "\n")  # appended after compress
    with pytest.raises(ArtifactError, match="run `kvscope compress` on it again"):
        rf.records("apc", "s")
    assert cli.main(["compress", str(run)]) == 0
    assert [r.request_id for r in read_jsonl(rf.records("apc", "s"), Record)] == ["r0", "r1", "r2"]
    assert not (run / "records" / "apc__s.jsonl").exists()


def test_compress_follows_no_link_in_a_run_folders_records(tmp_path, capsys):
    from kvscope import cli

    run = _hostile_run(tmp_path)
    outside = tmp_path / "elsewhere.jsonl"
    outside.write_text((run / "records" / "apc__s.jsonl").read_text())
    (run / "records" / "stolen__s.jsonl").symlink_to(outside)
    victim = _victim(tmp_path)
    (run / "records" / "baseline__s.jsonl.gz.part").symlink_to(victim)  # compress's temporary name, planted
    assert cli.main(["compress", str(run)]) == 2
    assert "stolen__s.jsonl: a symbolic link" in capsys.readouterr().err
    assert victim.read_text() == "ssh-ed25519 AAAA owner\n"
    assert not list((run / "records").glob("*.gz"))  # refused before anything was compressed
    assert outside.exists() and not (run / "records" / "stolen__s.jsonl.gz").exists()


HOSTILE_FOLDERS = {"a gzip bomb": "a line longer than", "records linked to /dev/zero": "a symbolic link",
                   "a FIFO as status.jsonl": "a FIFO", "run.json linked outside the folder": "a symbolic link",
                   "records/ linked to a folder elsewhere": "a symbolic link, not a folder"}


def test_a_hostile_run_folder_gives_exit_2_and_a_clear_message_never_a_hang_or_all_memory(tmp_path):
    import gzip

    from test_report import four, make_run

    for n, hostile in enumerate(HOSTILE_FOLDERS):
        run = make_run(tmp_path / str(n), four())
        records = run / "records" / "apc__s.jsonl"
        if hostile == "a gzip bomb":  # 4 MB of gzip members that inflate to one 4 GiB line
            records.unlink()
            (run / "records" / "apc__s.jsonl.gz").write_bytes(gzip.compress(b"a" * (16 << 20), mtime=0) * 256)
        elif hostile == "records linked to /dev/zero":
            records.unlink()
            records.symlink_to("/dev/zero")
        elif hostile == "a FIFO as status.jsonl":
            (run / "status.jsonl").unlink()
            os.mkfifo(run / "status.jsonl")
        elif hostile == "run.json linked outside the folder":
            (run / "run.json").rename(tmp_path / "run.json")
            (run / "run.json").symlink_to(tmp_path / "run.json")
        else:
            (run / "records").rename(tmp_path / "records")
            (run / "records").symlink_to(tmp_path / "records")
    # each report in one process of at most 3 GiB: where it read without bound, it would fail, not the machine
    code = ("import contextlib, io, json, resource, sys; from kvscope import cli; "
            "resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30)); out = []\n"
            "for run in sys.argv[1:]:\n"
            "    err = io.StringIO()\n"
            "    with contextlib.redirect_stderr(err): out.append((cli.main(['report', run]), err.getvalue()))\n"
            "print(json.dumps(out))")
    runs = [str(tmp_path / str(n)) for n in range(len(HOSTILE_FOLDERS))]
    done = subprocess.run([sys.executable, "-c", code, *runs], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    for (hostile, words), run, (code, err) in zip(HOSTILE_FOLDERS.items(), runs, json.loads(done.stdout), strict=True):
        assert code == 2 and words in err and run in err, (hostile, err)
        assert not (Path(run) / "report.md").exists()


def test_compare_writes_only_into_a_new_or_empty_folder(tmp_path, capsys):
    from test_report import four, make_run

    from kvscope import cli

    runs = [make_run(tmp_path / name, four()) for name in ("a", "b")]
    out = tmp_path / "out"
    out.mkdir()
    (out / "comparison.md").write_text("mine\n")
    assert cli.main(["compare", ",".join(map(str, runs)), "--out", str(out)]) == 2
    assert "not a new or empty folder" in capsys.readouterr().err
    assert [p.name for p in out.iterdir()] == ["comparison.md"] and (out / "comparison.md").read_text() == "mine\n"
    assert cli.main(["compare", ",".join(map(str, runs)), "--out", str(tmp_path / "new")]) == 0
    assert (tmp_path / "new" / "comparison.md").exists()
