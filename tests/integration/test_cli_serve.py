"""The two commands a user runs: ``baton serve`` in the foreground and ``baton generate``
against it, as real subprocesses; Ctrl-C (SIGINT) stops everything it started. The server runs
with an admin key and HTTPS, so ``baton status --endpoint`` and an HTTPS health check go through
``baton serve``'s own fronts."""

from __future__ import annotations

import json
import os
import re
import signal
import ssl
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.tls import self_signed

pytestmark = pytest.mark.engine

BATON = [sys.executable, "-m", "cli.main"]
REPO = Path(__file__).resolve().parents[2]


def _wait_for_line(proc: subprocess.Popen, log: Path, pattern: str, timeout_s: float) -> re.Match:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        match = re.search(pattern, log.read_text())
        if match:
            return match
        if proc.poll() is not None:
            pytest.fail(f"baton serve exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        time.sleep(0.5)
    pytest.fail(f"no '{pattern}' within {timeout_s} s:\n{log.read_text()[-3000:]}")


def _arenas() -> set[str]:
    return {p.name for p in Path("/dev/shm").glob("baton-clitest-*.arena")}


def test_serve_generate_and_ctrl_c(tmp_path):
    log = tmp_path / "serve.log"
    cert, key = self_signed(tmp_path, "front")
    admin_key = tmp_path / "admin.key"
    admin_key.write_text("clitest-admin-key\n")
    with open(log, "w") as out:
        proc = subprocess.Popen(
            BATON + ["serve", "--model", "tiny", "--port", "0", "--http-port", "0", "--set", "name=clitest",
                     "--set", "kvstore.host_capacity_bytes=67108864",
                     "--set", f"gateway.admin_key_file={admin_key}",
                     "--set", f"http.tls_cert_file={cert}", "--set", f"http.tls_key_file={key}"],
            stdout=out, stderr=subprocess.STDOUT, cwd=REPO,
        )
    try:
        port = _wait_for_line(proc, log, r"serving on 127\.0\.0\.1:(\d+)", 240).group(1)
        http_port = _wait_for_line(proc, log, r"serving HTTP on https://127\.0\.0\.1:(\d+)/v1", 10).group(1)
        target = f"127.0.0.1:{port}"
        assert len(_arenas()) == 1

        health = urllib.request.urlopen(f"https://127.0.0.1:{http_port}/health", timeout=10,
                                        context=ssl.create_default_context(cafile=str(cert)))
        assert health.status == 200
        status = subprocess.run(
            BATON + ["status", "--json", "--endpoint", target, "--admin-key-file", str(admin_key)],
            capture_output=True, text=True, timeout=120, cwd=REPO, env={**os.environ, "RAY_ADDRESS": ""},
        )
        assert status.returncode == 0, status.stderr
        shown = json.loads(status.stdout)
        assert shown["status"]["pool_sizes"] == {"prefill": {"ready": 1}, "decode": {"ready": 1}}
        assert shown["fronts"] == {"host_ip": "127.0.0.1", "grpc_port": int(port),
                                   "http_port": int(http_port), "http_tls": True,
                                   "grpc_host": "127.0.0.1", "http_host": "127.0.0.1"}

        as_json = subprocess.run(
            BATON + ["generate", "--target", target, "--json", "--max-tokens", "6", "Why is the sky blue?"],
            capture_output=True, text=True, timeout=120, cwd=REPO,
        )
        assert as_json.returncode == 0, as_json.stderr
        result = json.loads(as_json.stdout)
        assert set(result) == {"text", "token_ids", "finish_reason", "usage", "placement", "request_id"}
        assert len(result["token_ids"]) == 6 and result["finish_reason"] == "length"
        assert set(result["usage"]) >= {"prompt_tokens", "cached_tokens", "completion_tokens", "ttft_ms"}
        # the default policy (baton) prefills a short uncached prompt on its decode instance
        assert result["placement"]["policy"] == "baton"
        assert result["placement"]["prefill"] == result["placement"]["decode"] == "clitest-decode-0"
        assert result["placement"]["prefill_ms"] > 0 and "colocated" in result["placement"]["reason"]
        # the default sends the prompt through the chat template; --raw sends the text itself
        from engine.models import prepare_model
        from gateway.tokenization import PromptTokenizer

        tokenizer = PromptTokenizer(prepare_model("tiny").path)
        question = "Why is the sky blue?"
        assert result["usage"]["prompt_tokens"] == len(tokenizer.encode_chat([("user", question)]))
        raw = subprocess.run(
            BATON + ["generate", "--target", target, "--json", "--raw", "--max-tokens", "2", question],
            capture_output=True, text=True, timeout=120, cwd=REPO,
        )
        assert raw.returncode == 0, raw.stderr
        assert json.loads(raw.stdout)["usage"]["prompt_tokens"] == len(tokenizer.encode_text(question))

        streamed = subprocess.run(
            BATON + ["generate", "--target", target, "--chat", "--max-tokens", "6", "Why is the sky blue?"],
            capture_output=True, text=True, timeout=120, cwd=REPO,
        )
        assert streamed.returncode == 0, streamed.stderr
        assert "completion=6" in streamed.stderr and "prefill=clitest-decode-0" in streamed.stderr

        bad = subprocess.run(
            BATON + ["generate", "--target", target, "--temperature", "-1", "hi"],
            capture_output=True, text=True, timeout=120, cwd=REPO,
        )
        assert bad.returncode == 1
        assert "INVALID_ARGUMENT" in bad.stderr and "temperature" in bad.stderr

        chosen = subprocess.run(
            BATON + ["generate", "--target", target, "--json", "--max-tokens", "8",
                     "--temperature", "1", "--top-k", "20", "--choice", "yes", "--choice", "no",
                     "Is it?"],
            capture_output=True, text=True, timeout=120, cwd=REPO,
        )
        assert chosen.returncode == 0, chosen.stderr
        assert json.loads(chosen.stdout)["text"] in ("yes", "no")
        prefilled = subprocess.run(
            BATON + ["generate", "--target", target, "--json", "--max-tokens", "3",
                     "--prefill", "The sky is blue because", question],
            capture_output=True, text=True, timeout=120, cwd=REPO,
        )
        assert prefilled.returncode == 0, prefilled.stderr
        hf = tokenizer._tokenizer
        open_answer = hf.apply_chat_template(
            [{"role": "user", "content": question},
             {"role": "assistant", "content": "The sky is blue because"}],
            continue_final_message=True, tokenize=False)
        assert json.loads(prefilled.stdout)["usage"]["prompt_tokens"] == len(
            hf.encode(open_answer, add_special_tokens=False))
        raw_prefill = subprocess.run(
            BATON + ["generate", "--target", target, "--raw", "--prefill", "So", "hi"],
            capture_output=True, text=True, timeout=120, cwd=REPO,
        )
        assert raw_prefill.returncode == 2 and "--prefill" in raw_prefill.stderr
        bad_knob = subprocess.run(
            BATON + ["generate", "--target", target, "--min-p", "2", "hi"],
            capture_output=True, text=True, timeout=120, cwd=REPO,
        )
        assert bad_knob.returncode == 1
        assert "INVALID_ARGUMENT" in bad_knob.stderr and "sampling.min_p must be in [0, 1]" in \
            bad_knob.stderr
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    assert proc.returncode == 0, log.read_text()[-3000:]
    assert "stopped" in log.read_text()
    assert _arenas() == set()  # the store's shared memory is gone


def test_serve_rejects_a_bad_config_with_exit_code_2(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("prefill:\n  num_instances: -1\nconductor:\n  policy: nope\n")
    run = subprocess.run(BATON + ["serve", "--config", str(bad)], capture_output=True, text=True,
                         timeout=120, cwd=REPO)
    assert run.returncode == 2
    assert "prefill.num_instances" in run.stderr and "unknown policy 'nope'" in run.stderr
    # secrets and certificates are read before anything starts
    run = subprocess.run(BATON + ["serve", "--set", f"gateway.admin_key_file={tmp_path}/none",
                                  "--set", f"http.tls_cert_file={bad}", "--set", f"http.tls_key_file={bad}"],
                         capture_output=True, text=True, timeout=120, cwd=REPO)
    assert run.returncode == 2 and "gateway.admin_key_file: cannot read" in " ".join(run.stderr.split())
    run = subprocess.run(BATON + ["serve", "--set", f"http.tls_cert_file={bad}",
                                  "--set", f"http.tls_key_file={bad}"],
                         capture_output=True, text=True, timeout=120, cwd=REPO)
    assert run.returncode == 2 and "not a PEM certificate chain" in " ".join(run.stderr.split())


def test_generate_against_nothing_fails_cleanly():
    run = subprocess.run(BATON + ["generate", "--target", "127.0.0.1:1", "--timeout", "5", "hi"],
                         capture_output=True, text=True, timeout=60, cwd=REPO)
    assert run.returncode == 1
    assert "UNAVAILABLE" in run.stderr


def test_serve_says_why_an_engine_could_not_start_and_leaves_nothing_running(tmp_path):
    """A KV cache too small to hold anything: vLLM refuses to start the engine. The user gets
    vLLM's reason and exit code 2, promptly, and no arena is left."""
    before = _arenas()
    run = subprocess.run(BATON + ["serve", "--model", "tiny", "--port", "0", "--http-port", "0",
                                  "--set", "name=clitest-kv", "--set", "engine.num_kv_blocks=1",
                                  "--set", "kvstore.host_capacity_bytes=67108864"],
                         capture_output=True, text=True, timeout=300, cwd=REPO)
    said = " ".join(run.stderr.split())
    assert run.returncode == 2, run.stderr[-3000:]
    # vLLM's own reason, quoted: the cache has no room for a block of the context
    assert "engine failed to start: ValueError: No available memory for the cache blocks" in said, said[-2000:]
    assert _arenas() == before
    assert not any(p.name.startswith("baton-clitest-kv") for p in Path("/dev/shm").glob("*"))
