"""The vocabulary-parallel sampler (tensor parallelism): on logits split over the vocabulary, `sample` and
`prompt_logprobs` give the single-device results for every sampling mix (greedy, temperature, top-k / top-p / min-p
including ties and prefixes long enough for the bisection, penalties, banned tokens, seeds, logprobs, speculative
verify rows), and no collective of the compiled step carries a vocabulary-sized array: only per-row values and
the local top candidates cross devices. When tp does not divide the vocabulary the logits stay whole (replicated)
and the results are again the single device's.

jax fixes its device count when it starts, so the body runs in a subprocess on 4 simulated CPU devices.
"""

import pytest

from multidevice import run_on_devices

_SCRIPT = r"""
import functools, json, sys
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
from bench.hlo import parse_collectives, shape_arrays
from jaxserve import sharding
from jaxserve.sampler import SamplingInputs, prompt_logprobs, sample

assert len(jax.devices()) == 4
S, MAX_LOGPROBS, TRIALS = 12, 5, 8
rng = np.random.default_rng(0)


def inputs(V):
    s = SamplingInputs.neutral(S, 8)
    s.temperature[:] = [0, 1, 1, 1, 1, 1, 0.8, 1, 0.7, 1.5, 0, 1]
    s.top_k[:] = [0, 0, 5, 0, 200, 0, 0, 0, 50, 0, 0, 0]
    s.top_p[:] = [1, 1, 1, 0.9, 0.99, 1, 1, 1, 0.8, 0.999, 1, 1]
    s.min_p[:] = [0, 0, 0, 0, 0, 0.1, 0, 0, 0.02, 0, 0, 0]
    s.repetition_penalty[6], s.frequency_penalty[6], s.presence_penalty[6] = 1.3, 0.5, 0.4
    s.repetition_penalty[10] = 2.0  # greedy with penalties
    for r in (6, 10):  # history spread over every shard's ids
        s.history[r] = rng.integers(0, V, 8)
        s.history_is_output[r, ::2] = True
    s.banned[7, :3] = rng.integers(0, V, 3)
    s.wants_logprobs[::2] = True
    return s


def logits_of(V):
    x = (rng.normal(size=(S, V)) * 3).astype(np.float32)
    x[3] = np.round(x[3])  # long runs of ties at the top-p cut
    x[7, :] = x[7].max() - 20
    x[7, rng.integers(0, V, 3)] = x[7].max() + 5  # banned: it must be the banned ids that win without the ban
    return x


def run(V, tp):
    mesh = None
    if tp > 1:
        mesh = sharding.make_mesh(sharding.MeshConfig.preset(f"tp{tp}"), jax.devices()[:tp])
    logits, s = logits_of(V), inputs(V)
    s.banned[7, :3] = np.flatnonzero(logits[7] == logits[7].max())[:3]
    draft = np.where(rng.random(S) < 0.5, rng.integers(0, V, S), -1).astype(np.int32)
    draft[[0, 10]] = np.argmax(logits[[0, 10]], axis=-1)  # greedy rows whose draft is (probably) right
    targets = rng.integers(-1, V, S).astype(np.int32)
    split = P(None, "tp") if V % tp == 0 else P()  # as the LM head leaves them: split, or whole (tp does not divide V)
    in_sh = None if mesh is None else (NamedSharding(mesh, split), NamedSharding(mesh, P()))
    f = jax.jit(functools.partial(sample, max_logprobs=MAX_LOGPROBS, mesh=mesh), in_shardings=in_sh)
    g = jax.jit(lambda x, s, d: sample(x, s, max_logprobs=MAX_LOGPROBS, draft_ids=d, mesh=mesh),
                in_shardings=None if mesh is None else in_sh + (NamedSharding(mesh, P()),))
    h = jax.jit(lambda x, t: prompt_logprobs(x, t, max_logprobs=MAX_LOGPROBS, mesh=mesh),
                in_shardings=None if mesh is None else (in_sh[0], NamedSharding(mesh, P())))
    x = jnp.asarray(logits)
    out = {"sample": [], "verify": []}
    for trial in range(TRIALS):
        s.seeds[:] = rng.integers(0, 2**32, S, dtype=np.uint32)
        si = jax.tree.map(jnp.asarray, s)
        for name, o in (("sample", f(x, si)), ("verify", g(x, si, jnp.asarray(draft)))):
            out[name].append({k: np.asarray(v).tolist() for k, v in vars(o).items()})
    out["prompt"] = {k: np.asarray(v).tolist() for k, v in vars(h(x, jnp.asarray(targets))).items()}
    rng.bit_generator.state = np.random.default_rng(0).bit_generator.state  # every mesh sees the same data
    if mesh is not None and V % tp == 0:
        colls = []
        for fn, args in ((f, (x, si)), (g, (x, si, jnp.asarray(draft))), (h, (x, jnp.asarray(targets)))):
            colls += parse_collectives(fn.lower(*args).compile().as_text())
        out["collective_dims"] = sorted({d for c in colls for _, dims in shape_arrays(c.shape) for d in dims})
        out["num_collectives"] = sum(c.count + c.conditional_count for c in colls)
        out["largest_collective_bytes"] = max(c.buffer_bytes for c in colls)
    return out


report = {}
for V, tps in ((1000, (1, 2, 4)), (1002, (1, 4))):  # 1002: tp4 does not divide V, the logits stay whole
    for tp in tps:
        report[f"{V}/tp{tp}"] = run(V, tp)
print(json.dumps(report))
"""


@pytest.fixture(scope="module")
def report():
    return run_on_devices(_SCRIPT, devices=4, timeout=600)


def _assert_same(a: dict, b: dict, exact=("token_ids", "ranks", "top_ids", "accepted", "nonfinite")):
    for k in a:
        if k in exact:
            assert a[k] == b[k], k
        else:
            import numpy as np

            np.testing.assert_allclose(np.asarray(a[k]), np.asarray(b[k]), atol=2e-5, err_msg=k)


@pytest.mark.parametrize("case", ["1000/tp2", "1000/tp4", "1002/tp4"])
def test_sharded_sampler_equals_one_device(report, case):
    V = case.split("/")[0]
    single, sharded = report[f"{V}/tp1"], report[case]
    for kind in ("sample", "verify"):
        for a, b in zip(sharded[kind], single[kind]):
            _assert_same(a, b)
    _assert_same(sharded["prompt"], single["prompt"])
    # the mixes drew real variety: several distinct tokens per random row across trials, some drafts accepted
    tokens = [t["token_ids"] for t in single["sample"]]
    assert len({row[1] for row in tokens}) > 1 and any(any(t["accepted"]) for t in single["verify"])


@pytest.mark.parametrize("tp", [2, 4])
def test_no_collective_carries_the_vocabulary(report, tp):
    r = report[f"1000/tp{tp}"]
    assert r["num_collectives"] > 0  # the vocabulary really is split
    assert 1000 not in r["collective_dims"] and 1000 // tp not in r["collective_dims"]
    # the largest is the gather of each shard's top candidates (truncation), f32[S, tp * candidates]: not the
    # vocabulary, whose size it does not depend on
    from jaxserve.sampler import TRUNCATION_CANDIDATES

    assert r["largest_collective_bytes"] == 12 * tp * min(TRUNCATION_CANDIDATES, 1000 // tp) * 4
