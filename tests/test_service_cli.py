"""`jaxserve serve` as a process: SIGTERM drains without losing an accepted request and exits 0; TLS + API key.
And the command line itself (service/cli.py): engine options from the YAML and the flags, both subcommands."""

import asyncio
import json
import os
import re
import signal
import ssl
import subprocess
import sys

import aiohttp
import grpc
import pytest

from service.proto import jaxserve_v1_pb2 as pb
from service.proto import jaxserve_v1_pb2_grpc as pb_grpc
from service_fixtures import make_tiny_model_with_tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return make_tiny_model_with_tokenizer(str(tmp_path_factory.mktemp("tiny_cli")))


def _launch(path, *extra):
    cmd = [
        sys.executable, "-m", "service", "serve", "--model", path, "--served-model-name", "tiny",
        "--grpc-port", "0", "--http-port", "0", "--no-precompile", "--max-model-len", "256", "--max-num-seqs", "4",
        "--max-num-batched-tokens", "32", "--num-pages", "80", "--config", "configs/engine/cpu-default.yaml", *extra,
    ]  # fmt: skip
    env = dict(os.environ, JAX_PLATFORMS="cpu", HF_HUB_OFFLINE="1")
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    for line in proc.stdout:
        lines.append(line)
        m = re.search(r"grpc [\d.]+:(\d+), https? https?://[\d.]+:(\d+)", line)
        if m:
            proc.serving_line = line
            return proc, int(m.group(1)), int(m.group(2))
    proc.wait(timeout=10)
    raise AssertionError("server did not start:\n" + "".join(lines))


def _finish(proc, timeout=60):
    out, _ = proc.communicate(timeout=timeout)
    return proc.returncode, out


def test_sigterm_drains_every_accepted_request(path):
    proc, _, http_port = _launch(path, "--drain-timeout", "60")
    url = f"http://127.0.0.1:{http_port}/v1/completions"
    try:

        async def one(session, i, started):
            body = {"prompt": f"request {i}", "max_tokens": 120, "temperature": 0, "ignore_eos": True,
                    "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
            async with session.post(url, json=body) as r:
                assert r.status == 200
                events = []
                async for line in r.content:
                    if line.startswith(b"data: "):
                        events.append(line[6:].strip())
                        started.set()
                return events

        async def main():
            async with aiohttp.ClientSession() as s:
                flags = [asyncio.Event() for _ in range(3)]
                tasks = [asyncio.create_task(one(s, i, f)) for i, f in enumerate(flags)]
                await asyncio.gather(*(f.wait() for f in flags))  # all three are accepted and streaming
                proc.send_signal(signal.SIGTERM)
                await asyncio.sleep(0.05)
                try:  # a newcomer during the drain is refused (or finds the port already closed)
                    async with s.post(url, json={"prompt": "late", "max_tokens": 2}) as r:
                        late = r.status
                except aiohttp.ClientConnectionError:
                    late = None
                return await asyncio.gather(*tasks), late

        results, late = asyncio.run(main())
        code, out = _finish(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert code == 0, out
    assert "draining" in out and "all requests finished" in out
    assert late == 503, "health and admission close during the drain while accepted requests still run"
    for events in results:
        assert events[-1] == b"[DONE]"
        usage = json.loads(events[-2])["usage"]
        assert usage["completion_tokens"] == 120, "an accepted request was cut short"
        finish = [json.loads(e)["choices"][0]["finish_reason"] for e in events[:-2] if json.loads(e)["choices"]]
        assert finish[-1] == "length"


def test_tls_and_api_key(path, tmp_path):
    key, cert = str(tmp_path / "key.pem"), str(tmp_path / "cert.pem")
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", cert, "-days", "1",
         "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
        check=True, capture_output=True,
    )  # fmt: skip
    proc, grpc_port, http_port = _launch(path, "--tls-cert", cert, "--tls-key", key, "--api-key", "t0ken",
                                         "--quantization", "int8")
    assert "weights: quantization=int8, dtype=float32" in proc.serving_line  # the start line says the scheme
    try:
        ctx = ssl.create_default_context(cafile=cert)

        async def main():
            base = f"https://127.0.0.1:{http_port}"
            async with aiohttp.ClientSession() as s:
                async with s.get(base + "/health", ssl=ctx) as r:
                    health = r.status
                async with s.get(base + "/v1/models", ssl=ctx) as r:
                    no_key = r.status
                async with s.get(base + "/v1/models", ssl=ctx, headers={"Authorization": "Bearer t0ken"}) as r:
                    ok = (r.status, (await r.json())["data"][0]["id"])
            return health, no_key, ok

        assert asyncio.run(main()) == (200, 401, (200, "tiny"))
        with open(cert, "rb") as f:
            creds = grpc.ssl_channel_credentials(root_certificates=f.read())
        with grpc.secure_channel(f"127.0.0.1:{grpc_port}", creds) as ch:
            stub = pb_grpc.GenerationStub(ch)
            with pytest.raises(grpc.RpcError) as e:
                stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
            info = stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=(("authorization", "Bearer t0ken"),),
                                     timeout=10)
            assert info.model_name == "tiny"
            assert info.max_model_len == 256, "flags override the --config YAML"
        proc.send_signal(signal.SIGTERM)
        code, out = _finish(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert code == 0, out


# ---- the command line itself (no server) ----------------------------------------------------------------------


def _serve_args(*argv):
    from jaxserve.cli import build_parser
    from service.cli import add_serve_parser

    parser, sub = build_parser()
    s = add_serve_parser(sub)
    return parser.parse_args(["serve", *argv]), s


def test_engine_options_flags_override_the_config_yaml():
    from service.cli import engine_config_from

    args, s = _serve_args("--config", "configs/engine/cpu-small-memory.yaml", "--max-num-batched-tokens", "64",
                          "--max-num-seqs", "16")  # fmt: skip
    cfg = engine_config_from(args, s)
    assert (cfg.max_model_len, cfg.num_pages, cfg.max_num_batched_tokens) == (1024, 65, 64), "YAML, then flags"
    assert cfg.max_num_seqs == 8, "a flag left at its parser default does not override the YAML"
    assert cfg.token_buckets[-1] == 64, "buckets the YAML left to be derived follow the flags' budget"
    assert cfg.precompile, "servers precompile unless told not to"
    assert not engine_config_from(*_serve_args("--no-precompile")).precompile
    assert engine_config_from(*_serve_args("--quantization", "int4")).quantization == "int4"
    assert engine_config_from(*_serve_args()).quantization is None, "default: chosen per checkpoint at load"
    assert engine_config_from(*_serve_args("--no-async-scheduling")).async_scheduling is False
    assert engine_config_from(*_serve_args()).async_scheduling is None, "default: on where supported"
    assert engine_config_from(*_serve_args("--gpu-memory-utilization", "0.5")).gpu_memory_utilization == 0.5
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        engine_config_from(*_serve_args("--gpu-memory-utilization", "1.5"))


def test_engine_options_keep_what_the_yaml_sets(tmp_path):
    from service.cli import engine_config_from

    yaml_path = tmp_path / "engine.yaml"
    yaml_path.write_text("max_num_batched_tokens: 64\ntoken_buckets: [16, 64]\nprecompile: false\nmax_logprobs: 5\n")
    cfg = engine_config_from(*_serve_args("--config", str(yaml_path), "--max-model-len", "512"))
    assert (cfg.token_buckets, cfg.precompile, cfg.max_logprobs, cfg.max_model_len) == ((16, 64), False, 5, 512)


@pytest.mark.parametrize("text,match", [("max_num_seq: 4\n", "unknown engine option"), ("- 1\n", "expected a mapping")])
def test_a_bad_config_yaml_is_named(tmp_path, capsys, text, match):
    from service.cli import main

    yaml_path = tmp_path / "bad.yaml"
    yaml_path.write_text(text)
    assert main(["serve", "--config", str(yaml_path)]) == 2
    err = capsys.readouterr().err
    assert str(yaml_path) in err and match in err


def test_the_console_script_has_both_subcommands():
    from service.cli import main

    for command in ("serve", "generate"):
        with pytest.raises(SystemExit) as e:
            main([command, "--help"])
        assert e.value.code == 0
    out = subprocess.run([sys.executable, "-m", "jaxserve.cli", "--help"], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0 and "python -m service serve" in out.stdout, "the engine-only CLI points to serve"
