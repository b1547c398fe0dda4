"""The soak's clients: one request per call over OpenAI HTTP, jaxserve.v1 gRPC or KServe v2 gRPC, with its chaos.

A `Plan` says what to send and how to end it early (chaos): `cancel` stops reading after a few streamed chunks (or
after a delay for a non-streaming request) and closes the stream; `deadline` gives the call a short timeout;
`disconnect` drops the connection (HTTP: a raw socket reset with SO_LINGER 0; gRPC: closes the request's own
channel); `abort` (jaxserve.v1 only) calls `Generation/Abort` on the request id and reads on to the ABORT finish.
Every call returns one `Result` that ends exactly once, as one of
  completed  the protocol's final (finish_reason length / stop), text, token count;
  cancelled  the client ended it (the chaos action), or the server confirmed our abort;
  error      a clean refusal: an HTTP status with a JSON error body, an SSE error event, a gRPC status, a KServe
             in-band error_message;
  violation  anything else: an unexpected exception or lost connection, two finals, data after the final, a stream
             without its end marker, a non-JSON error body, no end within the hang timeout.
"""

from __future__ import annotations

import asyncio
import json
import socket
import struct
import time
from dataclasses import dataclass, field

CHAOS_KINDS = {"http": ("cancel", "deadline", "disconnect"), "grpc": ("cancel", "deadline", "disconnect", "abort"),
               "kserve": ("cancel", "deadline", "disconnect")}
OUTCOMES = ("completed", "cancelled", "error", "violation")


@dataclass(frozen=True, kw_only=True)
class Plan:
    id: str
    protocol: str  # http-completions | http-chat | grpc | kserve
    stream: bool  # HTTP only; gRPC and KServe always stream
    prompt: str
    prompt_index: int
    max_tokens: int
    greedy: bool
    ignore_eos: bool
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    chaos: str | None = None  # cancel | deadline | disconnect | abort
    chaos_chunks: int = 1  # cancel / abort after this many streamed chunks with output
    chaos_delay_s: float = 0.0  # cancel of a non-streaming request, disconnect: after this long
    deadline_s: float = 0.0

    @property
    def family(self) -> str:
        """Requests of one family and prompt render the same prompt tokens (so share a greedy reference)."""
        return "chat" if self.protocol == "http-chat" else "text"

    def sampling(self) -> dict:
        d = {"max_tokens": self.max_tokens, "temperature": self.temperature, "ignore_eos": self.ignore_eos}
        if not self.greedy:
            d |= {"top_p": self.top_p, "top_k": self.top_k} | ({} if self.seed is None else {"seed": self.seed})
        return d


@dataclass
class Result:
    plan: Plan
    outcome: str | None = None
    detail: str = ""  # error code / cancel kind / violation reason
    text: str = ""
    token_ids: list[int] | None = None  # jaxserve.v1 only
    finish_reason: str | None = None
    completion_tokens: int | None = None
    chunks: int = 0
    start: float = field(default_factory=time.perf_counter)
    latency_s: float = 0.0
    num_ends: int = 0  # must be 1: the exactly-once check

    def end(self, outcome: str, detail: str = "") -> "Result":
        assert outcome in OUTCOMES, outcome
        self.num_ends += 1
        if self.num_ends == 1:
            self.outcome, self.detail = outcome, detail[:300]
            self.latency_s = time.perf_counter() - self.start
        return self


# ---------------------------------------------------------------- OpenAI HTTP


def http_body(plan: Plan, model: str) -> tuple[str, dict]:
    body = {"model": model, **plan.sampling(), "stream": plan.stream}
    if plan.stream:
        body["stream_options"] = {"include_usage": True}
    if plan.protocol == "http-chat":
        return "/v1/chat/completions", body | {"messages": [{"role": "user", "content": plan.prompt}]}
    return "/v1/completions", body | {"prompt": plan.prompt}


class HttpClient:
    def __init__(self, base_url: str, model: str, hang_timeout_s: float):
        self.base_url, self.model, self.hang_timeout_s = base_url.rstrip("/"), model, hang_timeout_s
        self.session = None

    async def __aenter__(self):
        import aiohttp

        # No session timeout: each call has its own (the plan's deadline, else the hang timeout).
        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, force_close=True),
                                             timeout=aiohttp.ClientTimeout(total=None, sock_connect=30))
        return self

    async def __aexit__(self, *exc):
        await self.session.close()

    async def __call__(self, plan: Plan) -> Result:
        if plan.chaos == "disconnect":
            return await self._disconnect(plan)
        res = Result(plan)
        task = asyncio.ensure_future(self._request(plan, res))
        limit = plan.deadline_s if plan.chaos == "deadline" else self.hang_timeout_s
        if plan.chaos == "cancel" and not plan.stream:
            limit = plan.chaos_delay_s
        done, _ = await asyncio.wait([task], timeout=limit)
        if not done:  # the client gives up: cancelling the task closes the connection
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            if res.outcome is None and plan.chaos in ("deadline", "cancel"):
                res.end("cancelled", plan.chaos)
            elif res.outcome is None:
                res.end("violation", f"no end within {self.hang_timeout_s:.0f} s")
        elif task.exception() is not None:
            e = task.exception()
            res.end("violation", f"{type(e).__name__}: {e}")
        elif res.outcome is None:
            res.end("violation", "the response ended without an outcome")
        return res

    async def _request(self, plan: Plan, res: Result) -> None:
        import aiohttp

        path, body = http_body(plan, self.model)
        try:
            async with self.session.post(self.base_url + path, json=body) as resp:
                if resp.status != 200:
                    raw = await resp.text()
                    try:
                        err = json.loads(raw)["error"]
                        res.end("error", f"HTTP {resp.status} {err.get('type')}: {err.get('message', '')}")
                    except (ValueError, KeyError, TypeError):
                        res.end("violation", f"HTTP {resp.status} with a non-JSON error body: {raw[:200]!r}")
                    return
                if not plan.stream:
                    _read_json(plan, res, await resp.json())
                    return
                await self._read_sse(plan, res, resp)
        except (aiohttp.ClientError, json.JSONDecodeError, asyncio.IncompleteReadError) as e:
            if res.outcome is None:
                res.end("violation", f"{type(e).__name__}: {e}")

    @staticmethod
    async def _read_sse(plan: Plan, res: Result, resp) -> None:
        finished = done = False
        async for raw in resp.content:
            line = raw.decode("utf-8", "replace").strip()
            if not line:
                continue
            if not line.startswith("data:"):
                res.end("violation", f"not an SSE data line: {line[:100]!r}")
                return
            data = line[5:].strip()
            if done:
                res.end("violation", "data after [DONE]")
                return
            if data == "[DONE]":
                done = True
                continue
            msg = json.loads(data)
            if "error" in msg:
                err = msg["error"]
                res.end("error", f"stream error {err.get('code')} {err.get('type')}: {err.get('message', '')}")
                continue  # [DONE] follows
            if msg.get("usage"):
                res.completion_tokens = msg["usage"].get("completion_tokens")
            for c in msg.get("choices") or ():
                if finished:
                    res.end("violation", "a choice after the finish_reason")
                    return
                res.text += _choice_text(plan, c)
                res.chunks += 1
                if c.get("finish_reason"):
                    finished, res.finish_reason = True, c["finish_reason"]
            if plan.chaos == "cancel" and not finished and res.chunks >= plan.chaos_chunks:
                resp.close()  # the client hangs up mid-stream
                res.end("cancelled", "cancel")
                return
        if res.outcome is not None:
            return
        if not done:
            res.end("violation", "the stream ended without data: [DONE]")
        elif not finished:
            res.end("violation", "[DONE] without a finish_reason")
        elif res.finish_reason not in ("length", "stop"):
            res.end("violation", f"finish_reason {res.finish_reason!r} in a completed stream")
        else:
            res.end("completed")

    async def _disconnect(self, plan: Plan) -> Result:
        """A raw HTTP/1.1 request whose socket is reset (SO_LINGER 0) after `chaos_delay_s`, mid-response or not."""
        res = Result(plan)
        path, body = http_body(plan, self.model)
        host, port = self.base_url.removeprefix("http://").rsplit(":", 1)
        payload = json.dumps(body).encode()
        head = (f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n").encode()
        reader, writer = await asyncio.open_connection(host, int(port))
        got = b""
        try:
            writer.write(head + payload)
            await writer.drain()
            stop_at = time.monotonic() + plan.chaos_delay_s
            while (left := stop_at - time.monotonic()) > 0:
                try:
                    chunk = await asyncio.wait_for(reader.read(65536), left)
                except asyncio.TimeoutError:
                    break
                if not chunk:  # the server closed: the whole response came before our hang-up
                    break
                got += chunk
        finally:
            sock = writer.get_extra_info("socket")
            if sock is not None:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            writer.transport.abort()
        status = got.split(b" ", 2)[1] if got.startswith(b"HTTP/1.1 ") else b""
        if status and status != b"200":
            return res.end("error", f"HTTP {status.decode()} (raw)")
        complete = b"data: [DONE]" in got if plan.stream else (b"\r\n\r\n" in got and got.rstrip().endswith(b"}"))
        return res.end("completed", "raw, unchecked") if complete else res.end("cancelled", "disconnect")


def _choice_text(plan: Plan, choice: dict) -> str:
    """The text of one choice: `text` (completions), `delta.content` (chat stream) or `message.content` (chat)."""
    if plan.protocol != "http-chat":
        return choice.get("text") or ""
    return (choice.get("delta") or choice.get("message") or {}).get("content") or ""


def _read_json(plan: Plan, res: Result, body: dict) -> None:
    choices = body.get("choices") or []
    if len(choices) != 1:
        res.end("violation", f"{len(choices)} choices for n=1")
        return
    c = choices[0]
    res.text = _choice_text(plan, c)
    res.finish_reason = c.get("finish_reason")
    res.completion_tokens = (body.get("usage") or {}).get("completion_tokens")
    res.chunks = 1
    if res.finish_reason not in ("length", "stop"):
        res.end("violation", f"finish_reason {res.finish_reason!r} in a completed response")
    else:
        res.end("completed")


# ---------------------------------------------------------------- gRPC (jaxserve.v1 and KServe v2)


class GrpcClients:
    """Shared channels (round-robin) for jaxserve.v1 Generate and KServe ModelStreamInfer; `disconnect` requests
    get a channel of their own, closed under them."""

    def __init__(self, target: str, model: str, hang_timeout_s: float, num_channels: int = 4):
        self.target, self.model, self.hang_timeout_s, self.num_channels = target, model, hang_timeout_s, num_channels
        self.channels: list = []
        self._next = 0

    async def __aenter__(self):
        import grpc

        self.channels = [grpc.aio.insecure_channel(self.target, options=[("grpc.use_local_subchannel_pool", 1)])
                         for _ in range(self.num_channels)]
        return self

    async def __aexit__(self, *exc):
        for ch in self.channels:
            await ch.close()

    def _channel(self, plan: Plan):
        import grpc

        if plan.chaos == "disconnect":
            return grpc.aio.insecure_channel(self.target, options=[("grpc.use_local_subchannel_pool", 1)]), True
        self._next += 1
        return self.channels[self._next % len(self.channels)], False

    async def __call__(self, plan: Plan) -> Result:
        channel, own = self._channel(plan)
        res = Result(plan)
        timeout = plan.deadline_s if plan.chaos == "deadline" else self.hang_timeout_s
        run = self._generate if plan.protocol == "grpc" else self._kserve
        task = asyncio.ensure_future(run(plan, res, channel, timeout))
        closer = None
        if own:
            async def hang_up():
                await asyncio.sleep(plan.chaos_delay_s)
                if res.outcome is None:
                    res.end("cancelled", "disconnect")
                await channel.close(grace=None)

            closer = asyncio.ensure_future(hang_up())
        await asyncio.wait([task])  # never raises: a call cancelled under us (channel closed) must not end the caller
        if closer is not None:
            closer.cancel()
            await asyncio.gather(closer, return_exceptions=True)
            await channel.close(grace=None)
        if res.outcome is None:
            e = None if task.cancelled() else task.exception()
            res.end("violation", f"{type(e).__name__}: {e}" if e else "the call ended without an outcome")
        return res

    @staticmethod
    def _rpc_error(plan: Plan, res: Result, e) -> None:
        import grpc

        if res.outcome is not None:  # we ended it already (disconnect closes the channel under the call)
            return
        code = e.code()
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            res.end(*(("cancelled", "deadline") if plan.chaos == "deadline"
                      else ("violation", "no end within the hang timeout")))
        # a server exception / a call we did not cancel
        elif code in (grpc.StatusCode.UNKNOWN, grpc.StatusCode.CANCELLED):
            res.end("violation", f"gRPC {code.name}: {e.details()}")
        else:
            res.end("error", f"gRPC {code.name}: {e.details()}")

    async def _generate(self, plan: Plan, res: Result, channel, timeout: float) -> None:
        import grpc

        from service.proto import jaxserve_v1_pb2 as pb
        from service.proto import jaxserve_v1_pb2_grpc as pb_grpc

        stub = pb_grpc.GenerationStub(channel)
        s = plan.sampling()
        params = pb.SamplingParams(temperature=s["temperature"], max_tokens=s["max_tokens"], ignore_eos=s["ignore_eos"])
        for name in ("top_p", "top_k", "seed"):
            if name in s:
                setattr(params, name, s[name])
        call = stub.Generate(pb.GenerateRequest(request_id=plan.id, text=plan.prompt, sampling_params=params),
                             timeout=timeout)
        res.token_ids = []
        finished = aborted = False
        names = {pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_LENGTH: "length", pb.FINISH_REASON_ABORT: "abort"}
        try:
            async for out in call:
                if finished:
                    res.end("violation", "a response after the finished one")
                    return
                for d in out.outputs:
                    res.text += d.text
                    res.token_ids += list(d.token_ids)
                    if d.token_ids:
                        res.chunks += 1
                    if d.finish_reason:
                        if res.finish_reason is not None:
                            res.end("violation", "finish_reason twice")
                            return
                        res.finish_reason = names.get(d.finish_reason, str(d.finish_reason))
                if out.finished:
                    finished = True
                    res.completion_tokens = out.usage.completion_tokens
                if finished or res.outcome is not None:
                    continue
                if plan.chaos == "cancel" and res.chunks >= plan.chaos_chunks:
                    call.cancel()
                    res.end("cancelled", "cancel")
                    return
                if plan.chaos == "abort" and not aborted and res.chunks >= plan.chaos_chunks:
                    aborted = True
                    await stub.Abort(pb.AbortRequest(request_id=plan.id), timeout=30)
        except grpc.aio.AioRpcError as e:
            GrpcClients._rpc_error(plan, res, e)
            return
        if res.outcome is not None:
            return
        if not finished:
            res.end("violation", "the stream ended without a finished response")
        elif res.finish_reason == "abort":
            res.end("cancelled" if aborted else "violation", "abort" if aborted else "aborted without our Abort")
        elif res.finish_reason in ("length", "stop"):
            res.end("completed")
        else:
            res.end("violation", f"finished with finish_reason {res.finish_reason!r}")

    async def _kserve(self, plan: Plan, res: Result, channel, timeout: float) -> None:
        import grpc
        from tritonclient.grpc import service_pb2 as kpb
        from tritonclient.grpc import service_pb2_grpc as kpb_grpc

        req = kpb.ModelInferRequest(model_name=self.model, id=plan.id)
        sampling = {k: str(v).lower() if isinstance(v, bool) else str(v) for k, v in plan.sampling().items()}
        for name, datatype, raw in (("text_input", "BYTES", _pack(plan.prompt.encode())), ("stream", "BOOL", b"\x01"),
                                    ("sampling_parameters", "BYTES", _pack(json.dumps(sampling).encode())),
                                    ("return_finish_reason", "BOOL", b"\x01"),
                                    ("return_num_output_tokens", "BOOL", b"\x01")):
            req.inputs.add(name=name, datatype=datatype, shape=[1])
            req.raw_input_contents.append(raw)

        async def one():
            yield req

        call = kpb_grpc.GRPCInferenceServiceStub(channel).ModelStreamInfer(one(), timeout=timeout)
        final = False
        try:
            async for msg in call:
                if final:
                    res.end("violation", "a response after the final one")
                    return
                if msg.error_message:
                    res.end("error", f"KServe error: {msg.error_message}")
                    continue  # the stream then ends (our only request is over)
                r = msg.infer_response
                out = {o.name: raw for o, raw in zip(r.outputs, r.raw_output_contents)}
                text = _unpack(out.get("text_output", b""))
                res.text += text[0] if text else ""
                res.chunks += 1
                reason = _unpack(out.get("finish_reason", b""))
                if reason and reason[0]:
                    if res.finish_reason is not None:
                        res.end("violation", "finish_reason twice")
                        return
                    res.finish_reason = reason[0]
                if "num_output_tokens" in out and len(out["num_output_tokens"]) == 4:
                    res.completion_tokens = struct.unpack("<I", out["num_output_tokens"])[0]
                final = ("triton_final_response" in r.parameters
                         and r.parameters["triton_final_response"].bool_param)
                if not final and plan.chaos == "cancel" and res.chunks >= plan.chaos_chunks and res.outcome is None:
                    call.cancel()
                    res.end("cancelled", "cancel")
                    return
        except grpc.aio.AioRpcError as e:
            GrpcClients._rpc_error(plan, res, e)
            return
        if res.outcome is not None:
            return
        if not final:
            res.end("violation", "the stream ended without a triton_final_response")
        elif res.finish_reason in ("length", "stop"):
            res.end("completed")
        else:
            res.end("violation", f"final response with finish_reason {res.finish_reason!r}")


def _pack(b: bytes) -> bytes:
    return struct.pack("<I", len(b)) + b


def _unpack(raw: bytes) -> list[str]:
    out, i = [], 0
    while i + 4 <= len(raw):
        (n,) = struct.unpack_from("<I", raw, i)
        out.append(raw[i + 4 : i + 4 + n].decode("utf-8", "replace"))
        i += 4 + n
    return out
