"""SSE parsing edge cases, fed recorded vLLM stream bytes; no server needed."""

import json

from kvscope.artifacts import Request
from kvscope.run import records


def rec(endpoint="chat"):
    req = Request(request_id="r1", scenario="s", phase="measure", session_id="s1", turn=0, endpoint=endpoint, max_tokens=4)
    return records.new_record(req, "cfg", 0.0)


def chat_chunk(content=None, token_ids=None, role=None, finish=None, top=None):
    delta = {}
    if role:
        delta["role"] = role
    if content is not None:
        delta["content"] = content
    choice = {"index": 0, "delta": delta, "finish_reason": finish}
    if token_ids is not None:
        choice["token_ids"] = token_ids
    if top:
        choice["logprobs"] = {"content": [{"token": top[0][0], "logprob": top[0][1],
                                           "top_logprobs": [{"token": t, "logprob": lp} for t, lp in top]}]}
    return b"data: " + json.dumps({"choices": [choice]}).encode() + b"\n"


USAGE = b'data: {"choices":[],"usage":{"prompt_tokens":300,"completion_tokens":2,"prompt_tokens_details":{"cached_tokens":256}}}\n'
DONE = b"data: [DONE]\n"


def feed(*timed):
    return [(t, line) for t, line in timed]


def test_ttft_is_the_first_token_not_the_role_chunk_and_itl_follows():
    first = chat_chunk(role="assistant", content="")
    first = first.replace(b'"delta"', b'"prompt_token_ids": [1, 2, 3, 4, 5], "delta"', 1)
    lines = feed((0.10, first), (0.11, b"\n"), (0.30, chat_chunk(" Hello", [11], top=[[" Hello", -0.1], [" Hi", -2.0]])),
                 (0.45, chat_chunk(" world", [12], finish="length", top=[[" world", -0.5], [" there", -0.6]])),
                 (0.46, USAGE), (0.47, DONE))
    r = records.parse_stream(lines, 0.0, rec(), block_size=2)
    assert r.ok and r.error is None
    assert r.ttft_s == 0.30 and r.itl_s == [0.45 - 0.30] and r.e2e_s == 0.47
    assert r.output_text == " Hello world" and r.output_token_ids == [11, 12]
    assert (r.prompt_tokens, r.completion_tokens, r.cached_tokens) == (300, 2, 256)
    assert r.finish_reason == "length"
    assert r.top_logprobs[1] == [(" world", -0.5), (" there", -0.6)]
    assert len(r.prompt_block_hashes) == 2 and r.prompt_sha


def test_a_token_without_text_still_counts_for_ttft():
    lines = feed((0.2, chat_chunk("", [200])), (0.3, chat_chunk("é", [201])), (0.4, DONE))
    r = records.parse_stream(lines, 0.0, rec(), 128)
    assert r.ttft_s == 0.2 and r.output_token_ids == [200, 201]


def test_completions_stream():
    c1 = b'data: {"choices":[{"index":0,"text":"up","logprobs":{"tokens":["up"],"top_logprobs":[{" Dis":-4.6,"up":-4.0}]},"finish_reason":null,"prompt_token_ids":[42,71,3969],"token_ids":[454]}]}\n'
    r = records.parse_stream(feed((0.5, c1), (0.6, USAGE), (0.7, DONE)), 0.0, rec("completions"), 2)
    assert r.ok and r.ttft_s == 0.5 and r.output_text == "up"
    assert r.top_logprobs == [[("up", -4.0), (" Dis", -4.6)]]
    assert len(r.prompt_block_hashes) == 1


def test_truncated_stream_is_a_failed_record_that_keeps_what_arrived():
    r = records.parse_stream(feed((0.2, chat_chunk("a", [1]))), 0.0, rec(), 128)
    assert not r.ok and "truncated" in r.error and r.output_token_ids == [1]


def test_malformed_json_and_non_data_lines_fail_with_a_reason():
    r = records.parse_stream(feed((0.1, b"data: {not json\n"), (0.2, DONE)), 0.0, rec(), 128)
    assert not r.ok and "malformed SSE JSON" in r.error
    r = records.parse_stream(feed((0.1, b"<html>oops</html>\n")), 0.0, rec(), 128)
    assert not r.ok and "malformed SSE line" in r.error


def test_error_object_in_stream_and_empty_stream():
    err = b'data: {"error": {"message": "boom", "code": 500}}\n'
    r = records.parse_stream(feed((0.1, err), (0.2, DONE)), 0.0, rec(), 128)
    assert not r.ok and "boom" in r.error
    r = records.parse_stream(feed((0.1, DONE)), 0.0, rec(), 128)
    assert not r.ok and r.error == "no token in stream"


def test_missing_usage_stays_none_not_zero():
    r = records.parse_stream(feed((0.1, chat_chunk("a", [1])), (0.2, DONE)), 0.0, rec(), 128)
    assert r.ok and r.cached_tokens is None and r.prompt_tokens is None


def test_block_hashes_are_chained_and_full_blocks_only():
    a = records.block_hashes([1, 2, 3, 4, 5], 2)
    b = records.block_hashes([9, 2, 3, 4], 2)
    assert len(a) == 2 and len(b) == 2
    assert a[0] != b[0] and a[1] != b[1]  # same second block, different prefix: different key
    assert records.block_hashes([1, 2, 3, 4], 2) == a


def test_records_round_trip_and_truncated_file_is_named(tmp_path):
    path = tmp_path / "r.jsonl"
    records.write([rec()], path)
    assert records.read(path)[0].request_id == "r1"
    with open(path, "a") as f:
        f.write('{"config": "cfg", "scena')
    read = records.read(path)  # a last line cut short (a full disk): set aside and counted
    assert [r.request_id for r in read] == ["r1"] and read.torn == len('{"config": "cfg", "scena')
    with open(path, "a") as f:  # a line that ends, but truncated: an error naming the file and line
        f.write('\n' + rec().model_dump_json() + "\n")
    try:
        records.read(path)
        raise AssertionError("a truncated record must not pass")
    except ValueError as exc:
        assert f"{path}:2" in str(exc)


def test_alternatives_are_token_ids_and_the_prompt_is_kept_only_when_asked():
    first = chat_chunk("", [11], top=[["token_id:11", -0.1], ["token_id:12", -0.2]])
    first = first.replace(b'"delta"', b'"prompt_token_ids": [1, 2, 3, 4, 5], "delta"', 1)
    r = records.parse_stream(feed((0.1, first), (0.2, DONE)), 0.0, rec(), 2, keep_prompt=True)
    assert r.top_logprobs == [[(11, -0.1), (12, -0.2)]]  # '' for both byte tokens, told apart by id
    assert r.prompt_token_ids == [1, 2, 3, 4, 5]
    r = records.parse_stream(feed((0.1, first), (0.2, DONE)), 0.0, rec(), 2)
    assert r.prompt_token_ids is None and r.prompt_sha


def test_request_bodies_ask_for_token_ids_and_a_canary_fault():
    req = Request(request_id="r1", scenario="s", phase="measure", session_id="s1", turn=0, endpoint="chat",
                  max_tokens=4, messages=[{"role": "user", "content": "hi"}])
    _, body = records.request_body(req, [], "tiny")
    assert body["return_tokens_as_token_ids"] and "kv_transfer_params" not in body
    _, body = records.request_body(req, [], "tiny", fault="zeros")
    assert body["kv_transfer_params"] == {"kvscope_fault": "zeros"}
    key = records.request_key("rag-zipf-0003-t0", "measure")
    assert records.key_from_server_id(f"chatcmpl-{key}-1a2b3c4d") == key  # how vLLM names the request
    assert records.key_from_server_id(f"cmpl-{key}-0-96f52fa6") == key  # completions: a prompt index too


def test_a_logprob_that_is_not_a_number_is_kept_as_none_and_reads_back(tmp_path):
    """vLLM streams NaN (wrong KV loaded: UCM's NFS store after a bit flip, fp8 e5m2 KV with noise); JSON has no
    NaN, so the record keeps None there, in memory as on disk, and the run folder still reads."""
    nan = b'data: {"choices":[{"index":0,"delta":{"content":"a"},"token_ids":[7],"logprobs":{"content":[{"token":' \
          b'"token_id:7","logprob":NaN,"top_logprobs":[{"token":"token_id:7","logprob":NaN},{"token":"token_id:9",' \
          b'"logprob":-Infinity}]}]}}]}\n'
    r = records.parse_stream(feed((0.1, nan), (0.2, USAGE), (0.3, DONE)), 0.0, rec(), block_size=16)
    assert r.ok and r.top_logprobs == [[(7, None), (9, None)]]
    path = tmp_path / "r.jsonl"
    records.write([r], path)
    assert records.read(path)[0].top_logprobs == [[(7, None), (9, None)]]
