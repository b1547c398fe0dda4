"""Quantized linear maps compiled for an H200 without a GPU (deviceless sm_90, `tests/sm90_aot.py`): the XLA
linear maps (`ops.linear`) must compile without writing a dequantized bf16 copy of the weight to memory first: the
compiled step's temporary memory stays below half the bf16 weight's size, at decode (1 and 16 rows) and prefill
(256 rows) shapes. XLA's GPU compiler fuses a plain convert into its GEMM (bf16, and int8 per channel with the
scale applied to the product) but not a group-wise scale or a 4-bit unpack, so group-wise weights (4-bit with
zeros as GGUF Q4_1 / Q4_K, int8 in groups as Q8_0) run the Pallas kernel (`pallas_kernels.quant_matmul`).

This is what makes quantized weights pay on a GPU: decode streams the weights once per step, so a materialized
bf16 copy would cost more bandwidth than bf16 weights themselves. (Whether the fused kernels reach the bandwidth
roofline can only be measured on a GPU: `scripts/bench_gpu.sh`.)
"""

import os

import pytest

from sm90_aot import run_compile_child

K, N = 2048, 8192  # a Llama-3-8B-like MLP projection: a bf16 copy would be 32 MiB


CHILD = r"""
import json, sys, time
import jax, jax.numpy as jnp, numpy as np
sys.path.insert(0, %(TESTS)r)
from sm90_aot import h200_spec_factory
from jaxserve import ops, quant

spec = h200_spec_factory()
K, N = %(K)d, %(N)d
rng = np.random.default_rng(0)
w = rng.normal(0, 0.05, (K, N)).astype(np.float32)
forms = {"int8": quant.quantize_int8(w), "bf16": w.astype(jnp.bfloat16),
         # group-wise: the Pallas kernel (`Backends.matmul == "pallas"`, the GPU default)
         "int4-g32": quant.with_kernel(quant.quantize_int4(w, 32), "pallas"),
         "int8-g32": quant.with_kernel(quant.from_values(rng.integers(-127, 128, (K, N)), np.ones((K // 32, N)),
                                                         None, 8), "pallas")}
for name, host in forms.items():
    abstract = jax.tree.map(lambda a: spec(a.shape, a.dtype), host)
    for rows in (1, 16, 256):
        x = spec((rows, K), jnp.bfloat16)
        start = time.perf_counter()
        try:
            exe = jax.jit(ops.linear).lower(x, abstract).compile()
            mem = exe.memory_analysis()
            text = exe.as_text()
            out = dict(id=f"{name}/{rows}", ok=True, temp_bytes=int(mem.temp_size_in_bytes),
                       arg_bytes=int(mem.argument_size_in_bytes), pallas="quant_matmul" in text)
        except Exception as e:  # noqa: BLE001
            out = dict(id=f"{name}/{rows}", ok=False, error=f"{type(e).__name__}: {e}"[:2000])
        out["seconds"] = round(time.perf_counter() - start, 2)
        print(json.dumps(out), flush=True)
"""


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    script = tmp_path_factory.mktemp("sm90q") / "child.py"
    script.write_text(CHILD % dict(K=K, N=N, TESTS=os.path.dirname(os.path.abspath(__file__))))
    return run_compile_child(str(script))


@pytest.mark.parametrize("form", ["int8", "bf16", "int4-g32", "int8-g32"])
@pytest.mark.parametrize("rows", [1, 16, 256])
def test_quantized_linear_compiles_for_sm90_with_dequantization_fused(compiled, form, rows):
    r = compiled[f"{form}/{rows}"]
    assert r["ok"], r.get("error")
    assert r["pallas"] == form.endswith("-g32")  # groups: the kernel; per channel and bf16: XLA's fused GEMM
    bf16_weight = K * N * 2
    assert r["temp_bytes"] < bf16_weight // 2, (
        f"{form} at {rows} rows: {r['temp_bytes']} temporary bytes: the bf16 weight ({bf16_weight}) is materialized")
