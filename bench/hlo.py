"""Collectives in compiled HLO text: every all-reduce / all-gather / reduce-scatter / collective-permute /
all-to-all of a partitioned module, with its shape, device group, the jax op it came from and how often it runs per
execution (loop trip counts multiply; ops inside a `conditional` branch count apart, since they run only when the
branch does), and the bytes each device sends for it on a ring. Used by `bench/collectives.py` and the tests that
count a compiled step's collectives."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

COLLECTIVE_KINDS = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all")
DTYPE_BYTES = {"pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4,
               "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16, "token": 0}


# ---------------------------------------------------------------- bytes


def dtype_bytes(dtype: str) -> float:
    if dtype not in DTYPE_BYTES and not dtype.startswith("f8"):
        raise ValueError(f"unknown HLO element type {dtype!r}")
    return DTYPE_BYTES.get(dtype, 1)


def bytes_sent_per_device(kind: str, buffer_bytes: float, group_size: int) -> float:
    """Bytes one device sends for one collective over `group_size` devices, ring algorithms. `buffer_bytes`: the
    full buffer: all-reduce the reduced array, all-gather the gathered result, reduce-scatter the operand before
    scattering, all-to-all and collective-permute one device's operand."""
    n = group_size
    if n <= 1:
        return 0.0
    if kind == "all-reduce":  # reduce-scatter then all-gather: 2 (n-1) chunks of B/n
        return 2 * (n - 1) / n * buffer_bytes
    if kind in ("all-gather", "reduce-scatter", "all-to-all"):  # n-1 chunks of B/n
        return (n - 1) / n * buffer_bytes
    if kind == "collective-permute":  # point to point: the whole buffer
        return float(buffer_bytes)
    raise ValueError(f"unknown collective {kind!r}; one of {', '.join(COLLECTIVE_KINDS)}")


# ---------------------------------------------------------------- HLO text


@dataclass(frozen=True)
class Collective:
    """One collective instruction of a compiled module and how often it runs per execution."""

    kind: str  # one of COLLECTIVE_KINDS
    shape: str  # the result's HLO shape, e.g. "f32[16,576]" or "(f32[16], f32[16])"
    buffer_bytes: float  # see `bytes_sent_per_device`
    group_size: int  # devices in each replica group (collective-permute: devices in its source-target pairs)
    op_name: str  # jax's op_name metadata: which jitted code it came from
    count: int  # executions per step outside any conditional branch (loop trip counts multiplied)
    conditional_count: int  # executions per step inside conditional branches (only when the branch runs)

    @property
    def bytes_per_device(self) -> float:
        """Bytes one device sends per execution."""
        return bytes_sent_per_device(self.kind, self.buffer_bytes, self.group_size)

    @property
    def in_layers(self) -> bool:
        """Inside a decoder layer (the model's `attention` / `mlp` named scopes)."""
        return bool(re.search(r"/(attention|mlp)/", self.op_name))


_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,]*)\]")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*")
_HEADER = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s")
_CALLS = re.compile(r"\b(body|condition|calls|to_apply|true_computation|false_computation)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"\bbranch_computations=\{([^}]*)\}")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_GROUPS = re.compile(r"\breplica_groups=(\{\{[^=]*?\}\}|\{\}|\[[\d,]+\]<=\[[\d,]+\](?:T\([\d,]+\))?"
                     r"|mesh\[[^\]]*\]\s*\{[^}]*\})")
_PAIRS = re.compile(r"\bsource_target_pairs=\{(.*?)\}\}")
_PARTITIONS = re.compile(r"\bnum_partitions=(\d+)")


def _split_shape(rest: str) -> tuple[str, str]:
    """'(f32[2]{0}, s32[]) all-reduce(...)' -> ('(f32[2]{0}, s32[])', ' all-reduce(...)')."""
    if rest.startswith("("):
        depth = 0
        for i, c in enumerate(rest):
            depth += c == "("
            depth -= c == ")"
            if depth == 0:
                return rest[: i + 1], rest[i + 1:]
    i = rest.find(" ")
    return (rest, "") if i < 0 else (rest[:i], rest[i:])


def shape_arrays(shape: str) -> list[tuple[str, tuple[int, ...]]]:
    """The (dtype, dims) of every array in an HLO shape, tuples flattened in order."""
    return [(t, tuple(int(d) for d in dims.split(",") if d)) for t, dims in _ARRAY.findall(shape)]


def array_bytes(arrays: list[tuple[str, tuple[int, ...]]]) -> float:
    return sum(dtype_bytes(t) * math.prod(dims) for t, dims in arrays)


def group_size(attrs: str, num_partitions: int) -> int:
    """Devices per replica group: {{0,1},{2,3}} -> 2; [2,4]<=[8] -> 4; mesh['a'=2,'b'=4] {'b'} -> 4; {} -> all."""
    m = _GROUPS.search(attrs)
    if m is None:
        pairs = _PAIRS.search(attrs)
        if pairs:  # collective-permute: the devices its pairs touch
            return len(set(re.findall(r"\d+", pairs.group(1))))
        return num_partitions
    g = m.group(1)
    if g == "{}":
        return num_partitions
    if g.startswith("{{"):
        return len(re.findall(r"\d+", g[2:g.index("}")]))
    if g.startswith("["):
        return int(g[1:g.index("]")].split(",")[-1])
    sizes = dict(re.findall(r"'([^']+)'=(\d+)", g[: g.index("]")]))
    return math.prod(int(sizes[a]) for a in re.findall(r"'([^']+)'", g[g.index("]") + 1:]))


@dataclass
class _Instr:
    name: str
    shape: str
    opcode: str
    operand: str | None  # the first operand's name
    attrs: str  # the rest of the line


def parse_module(text: str) -> tuple[dict[str, list[_Instr]], str | None, int]:
    """HLO module text -> ({computation: instructions}, the entry computation's name, num_partitions)."""
    comps: dict[str, list[_Instr]] = {}
    entry, current = None, None
    m = _PARTITIONS.search(text.split("\n", 1)[0])
    partitions = int(m.group(1)) if m else 1
    for line in text.splitlines():
        if not line.strip() or line.startswith("HloModule"):
            continue
        if not line[0].isspace():
            if line.rstrip().endswith("{") and (h := _HEADER.match(line)):
                current = h.group(1)
                comps[current] = []
                if line.startswith("ENTRY"):
                    entry = current
            elif line.startswith("}"):
                current = None
            continue
        if current is None or (im := _INSTR.match(line)) is None:
            continue
        shape, after = _split_shape(line[im.end():])
        om = re.match(r"\s*([\w\-]+)\(%?([\w.\-]*)", after)
        if om is None:
            continue
        comps[current].append(_Instr(im.group(1), shape, om.group(1), om.group(2) or None, after[om.end():]))
    return comps, entry, partitions


def _executions(comps: dict[str, list[_Instr]], entry: str) -> dict[str, tuple[int, int]]:
    """Per computation, (executions outside conditionals, executions inside a conditional branch) per run of
    the entry: while bodies run their known trip count (1 if unknown), fusions and calls once per call site."""
    edges: dict[str, list[tuple[str, int, bool]]] = {c: [] for c in comps}  # caller -> (callee, factor, in branch)
    for c, instrs in comps.items():
        for ins in instrs:
            trip = _TRIP.search(ins.attrs)
            for role, callee in _CALLS.findall(ins.attrs):
                if role == "to_apply" or callee not in comps:  # reducers hold no collectives
                    continue
                factor = int(trip.group(1)) if role == "body" and trip else 1
                edges[c].append((callee, factor, role in ("true_computation", "false_computation")))
            for b in _BRANCHES.findall(ins.attrs):
                edges[c] += [(callee.strip().lstrip("%"), 1, True) for callee in b.split(",") if callee.strip()]
    runs = {c: [0, 0] for c in comps}

    def visit(c: str, always: int, maybe: int, depth: int = 0):
        if depth > 64:
            raise ValueError(f"HLO call graph deeper than 64 at {c}")
        runs[c][0] += always
        runs[c][1] += maybe
        for callee, factor, branch in edges[c]:
            if callee in comps:
                visit(callee, 0 if branch else always * factor, (maybe + (always if branch else 0)) * factor,
                      depth + 1)

    visit(entry, 1, 0)
    return {c: (a, m) for c, (a, m) in runs.items()}


def parse_collectives(text: str) -> list[Collective]:
    """Every collective of a compiled HLO module with its executions per run, identical ones merged. Async pairs
    (GPU: `all-reduce-start` / `-done`) count once, sized by the `-done` (the result) with the `-start`'s groups."""
    comps, entry, partitions = parse_module(text)
    if entry is None:
        raise ValueError("no ENTRY computation in the HLO text")
    runs = _executions(comps, entry)
    merged: dict[tuple, list[int]] = {}
    for c, instrs in comps.items():
        always, maybe = runs[c]
        if not always and not maybe:
            continue
        by_name = {ins.name: ins for ins in instrs}
        for ins in instrs:
            op = ins.opcode
            if op.endswith("-start"):
                continue
            if op.endswith("-done"):
                start = by_name.get(ins.operand)
                kind, attrs = op[: -len("-done")], (start.attrs if start else ins.attrs)
            else:
                kind, attrs = op, ins.attrs
            if kind not in COLLECTIVE_KINDS:
                continue
            arrays = shape_arrays(ins.shape)
            if kind == "collective-permute" and len(arrays) > 1:  # a sync form with (result, ...) sizes the first
                arrays = arrays[:1]
            n = group_size(attrs, partitions)
            buffer = array_bytes(arrays) * (n if kind == "reduce-scatter" else 1)  # its result is 1/n of the operand
            name = _OP_NAME.search(attrs)
            key = (kind, re.sub(r"\{[\d,]*\}", "", ins.shape), buffer, n, name.group(1) if name else "")
            acc = merged.setdefault(key, [0, 0])
            acc[0] += always
            acc[1] += maybe
    return [Collective(*k, count=a, conditional_count=m) for k, (a, m) in merged.items()]


def summarize(collectives: list[Collective], num_tokens: int, num_layers: int) -> dict:
    """Counts and bytes per device per step, split into the layers and the rest; per token and per layer."""
    always = [c for c in collectives if c.count]
    layers = [c for c in always if c.in_layers]
    outside = [c for c in always if not c.in_layers]
    cond = [c for c in collectives if c.conditional_count]

    def total(cs, attr="count"):
        return sum(getattr(c, attr) * c.bytes_per_device for c in cs)

    layer_bytes = total(layers)
    return dict(
        num_collectives=sum(c.count for c in always),
        num_in_layers=sum(c.count for c in layers),
        num_outside_layers=sum(c.count for c in outside),
        bytes_per_step=total(always),
        bytes_in_layers=layer_bytes,
        bytes_outside_layers=total(outside),
        bytes_per_token=total(always) / num_tokens,
        bytes_per_token_per_layer=layer_bytes / num_tokens / num_layers,
        num_conditional=sum(c.conditional_count for c in cond),
        bytes_conditional=total(cond, "conditional_count"),
    )
