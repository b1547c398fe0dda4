"""Load-generator client for jaxserve's gRPC `jaxserve.v1.Generation/Generate` stream (same contract as the HTTP one).

Each streamed response carries the new token ids, so token counts and inter-token gaps are exact per response.
"""

from __future__ import annotations

import time

from bench.loadgen import LoadRequest, RequestResult


class JaxserveGrpcClient:
    def __init__(self, target: str, *, api_key: str | None = None, ignore_eos: bool = True, timeout_s: float = 600.0):
        self.target = target.removeprefix("grpc://")
        self.metadata = (("authorization", f"Bearer {api_key}"),) if api_key else ()
        self.ignore_eos = ignore_eos
        self.timeout_s = timeout_s
        self._channel = self._stub = None

    async def __aenter__(self):
        import grpc

        from service.proto import jaxserve_v1_pb2_grpc

        self._channel = grpc.aio.insecure_channel(self.target)
        self._stub = jaxserve_v1_pb2_grpc.GenerationStub(self._channel)
        return self

    async def __aexit__(self, *exc):
        await self._channel.close()

    async def __call__(self, req: LoadRequest) -> RequestResult:
        from service.proto import jaxserve_v1_pb2 as pb

        params = pb.SamplingParams(temperature=0.0, max_tokens=req.output_len, ignore_eos=self.ignore_eos)
        msg = (pb.GenerateRequest(text=req.prompt, sampling_params=params) if isinstance(req.prompt, str) else
               pb.GenerateRequest(token_ids=pb.TokenIds(ids=req.prompt), sampling_params=params))
        res = RequestResult(ok=False, prompt_len=req.prompt_len)
        res.start = last = time.perf_counter()
        tokens = 0
        try:
            async for out in self._stub.Generate(msg, timeout=self.timeout_s, metadata=self.metadata):
                new = sum(len(c.token_ids) for c in out.outputs)
                if new:
                    now = time.perf_counter()
                    if tokens == 0:
                        res.ttft = now - res.start
                    else:
                        res.itl.append(now - last)
                    last = now
                    tokens += new
        except Exception as e:  # noqa: BLE001 - a failed RPC is one failed request, reported with its status
            if callable(getattr(e, "code", None)) and callable(getattr(e, "details", None)):
                res.error = f"gRPC {e.code().name}: {e.details()}"[:300]
            else:
                res.error = f"{type(e).__name__}: {e}"[:300]
            return res
        res.latency = time.perf_counter() - res.start
        res.output_len = tokens
        res.ok = tokens > 0
        if not res.ok:
            res.error = "no generated tokens in the stream"
        return res
