"""Count the kernels of a compiled program from its optimized HLO text (`compiled.as_text()`).

    census = hlo_census.census(jax.jit(f).lower(*args).compile().as_text())
    census.launches_per_call, census.by_family

Every instruction of the entry computation (and of the computations it reaches through `call`, `while` and
`conditional`) that runs as a kernel of its own counts as one launch: fusions, custom calls (our FFI and Pallas
kernels, cuBLAS GEMMs), copies, gathers, sorts, collectives and so on; parameters, constants, tuples, bitcasts and
control flow do not. A `while` body counts once per iteration where XLA knows the trip count
(`known_trip_count`); a loop without one counts once and is listed in `unknown_trip_counts`. Each launch is
attributed to the model part named by the innermost `jax.named_scope` of its `op_name` metadata (the scopes the
model sets: see FAMILY_OF_SCOPE), collectives by their opcode, and to the kind of layer whose scope it lies in
(LAYER_SCOPES).

    hlo_census.strided_gathers(text)     # gathers that read one element per memory sector (layout waste)

lists the gathers whose slices are not contiguous in memory, with the bytes they use and the sectors they touch: it
found the MoE kernel's outputs read back about 8x (pallas_kernels/moe.py now stores its tiles row-major).

    hlo_census.slice_copies(text)        # large dynamic slices written out as buffers of their own

lists the slices a program copies instead of reading in place: it found a scanned prefill copying each layer's
routed expert weights per iteration (docs/performance.md, "Depth").

    hlo_census.kernel_bytes(text)        # what the kernels read and write, by family and by site (an upper bound)

compares two versions of a program compiled for a GPU that is not there: it found the mHC sites' stream mix
written out and read back in float32.
"""

from __future__ import annotations

import collections
import dataclasses
import re

# named_scope set in the model code -> the op family it is reported as
FAMILY_OF_SCOPE = {
    "fp8_matmul": "fp8 matmul", "fp4_matmul": "fp4 matmul", "bf16_matmul": "bf16 matmul",
    "attention": "attention", "indexer": "indexer", "compressor": "compressor", "mhc": "mhc",
    "norm": "norm/rope", "rope": "norm/rope", "router": "router", "routed_experts": "moe dispatch/combine",
    "embed": "embed", "sampling": "sampling",
}
FAMILIES = tuple(dict.fromkeys(FAMILY_OF_SCOPE.values())) + ("collectives", "other")
# model.block's scope per layer kind (model.layer_kind); launches outside every layer are "outside layers"
LAYER_SCOPES = {"window_layer": "window", "csa_layer": "csa", "hca_layer": "hca", "mtp_layer": "mtp"}
LAYER_KINDS = tuple(LAYER_SCOPES.values()) + ("outside layers",)
COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute",
               "collective-broadcast", "ragged-all-to-all")
# Opcodes that never launch a kernel of their own.
_NOT_KERNELS = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "call", "while", "conditional",
                "after-all", "add-dependency", "opt-barrier", "partition-id", "replica-id", "domain",
                "get-dimension-size", "set-dimension-size"}

_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?(?P<name>[^\s=]+)\s*=\s*(?P<rest>.*)$")
_COMPUTATION = re.compile(r"^(?P<entry>ENTRY\s+)?%?(?P<name>[^\s(]+)\s*\(.*\{\s*$")


@dataclasses.dataclass
class Instruction:
    name: str
    opcode: str
    op_name: str
    callees: dict[str, list[str]]      # "to_apply" / "body" / "condition" / "branches" -> computation names
    trip_count: int | None


@dataclasses.dataclass
class Census:
    top_level_kernels: int             # kernels outside any while loop
    launches_per_call: int             # loop bodies counted once per iteration
    custom_calls: int                  # per call
    while_loops: int                   # loops reached from the entry computation
    collectives: int                   # per call
    by_family: dict[str, int]          # launches per call, by op family
    by_layer_kind: dict[str, int]      # launches per call, by the kind of layer that launched them
    unknown_trip_counts: int = 0

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def _opcode(rest: str) -> str:
    """`rest` is the text after 'name = ': a shape (possibly a parenthesised tuple) then 'opcode(...'."""
    i = 0
    if rest.startswith("("):
        depth = 0
        for i, ch in enumerate(rest):
            depth += ch == "("
            depth -= ch == ")"
            if depth == 0:
                break
        i += 1
    else:
        i = rest.find(" ")
    rest = rest[i:].lstrip()
    return rest[:rest.find("(")] if "(" in rest else rest


def _callees(rest: str, opcode: str) -> dict[str, list[str]]:
    out = {}
    if opcode == "call":
        m = re.search(r"to_apply=%?([^\s,}]+)", rest)
        out["to_apply"] = [m.group(1)] if m else []
    elif opcode == "while":
        for key in ("body", "condition"):
            m = re.search(key + r"=%?([^\s,}]+)", rest)
            out[key] = [m.group(1)] if m else []
    elif opcode == "conditional":
        m = re.search(r"branch_computations=\{([^}]*)\}", rest)
        names = m.group(1).split(",") if m else re.findall(r"(?:true|false)_computation=%?([^\s,}]+)", rest)
        out["branches"] = [n.strip().lstrip("%") for n in names if n.strip()]
    return out


def parse(hlo_text: str) -> tuple[dict[str, list[Instruction]], str]:
    """Computations (name -> instructions) and the entry computation's name."""
    computations: dict[str, list[Instruction]] = {}
    entry, current = None, None
    for line in hlo_text.splitlines():
        if current is None:
            m = _COMPUTATION.match(line)
            if m:
                current = m.group("name")
                computations[current] = []
                if m.group("entry"):
                    entry = current
            continue
        if line.strip() == "}":
            current = None
            continue
        m = _INSTRUCTION.match(line)
        if not m:
            continue
        rest = m.group("rest")
        opcode = _opcode(rest)
        op_name = re.search(r'op_name="([^"]*)"', rest)
        trip = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', rest)
        computations[current].append(Instruction(m.group("name"), opcode, op_name.group(1) if op_name else "",
                                                 _callees(rest, opcode), int(trip.group(1)) if trip else None))
    if entry is None:
        raise ValueError("no ENTRY computation in this HLO text")
    return computations, entry


def family(instruction: Instruction) -> str:
    """The op family of one launch: collectives by opcode, else the innermost model scope of its op_name."""
    if instruction.opcode.removesuffix("-start") in COLLECTIVES:
        return "collectives"
    for part in reversed(instruction.op_name.split("/")):
        if part in FAMILY_OF_SCOPE:
            return FAMILY_OF_SCOPE[part]
    return "other"


def layer_of(instruction: Instruction) -> str:
    """The kind of layer (LAYER_KINDS) whose scope an instruction lies in."""
    for part in instruction.op_name.split("/"):
        if part in LAYER_SCOPES:
            return LAYER_SCOPES[part]
    return "outside layers"


def is_kernel(instruction: Instruction) -> bool:
    op = instruction.opcode
    return op not in _NOT_KERNELS and not op.endswith("-done")


def _walk(computations: dict[str, list[Instruction]], name: str, multiplier: int = 1, in_loop: bool = False):
    """(computation, instruction, runs per call, inside a loop) for every kernel and every `while` reachable from
    computation `name`: a loop body runs once per iteration (once where XLA does not know the trip count), its
    condition once more, and every branch of a conditional is counted (an upper bound)."""
    for ins in computations.get(name, []):
        if ins.opcode == "while":
            yield name, ins, multiplier, in_loop
            trips = ins.trip_count or 1
            yield from _walk(computations, ins.callees["body"][0], multiplier * trips, True)
            yield from _walk(computations, ins.callees["condition"][0], multiplier * (trips + 1), True)
        elif ins.opcode == "call":
            yield from _walk(computations, ins.callees["to_apply"][0], multiplier, in_loop)
        elif ins.opcode == "conditional":
            for branch in ins.callees["branches"]:
                yield from _walk(computations, branch, multiplier, in_loop)
        elif is_kernel(ins):
            yield name, ins, multiplier, in_loop


def census(hlo_text: str) -> Census:
    computations, entry = parse(hlo_text)
    by_family = collections.Counter()
    by_layer = collections.Counter()
    totals = collections.Counter()
    for _, ins, multiplier, in_loop in _walk(computations, entry):
        if ins.opcode == "while":
            totals["while_loops"] += 1
            totals["unknown_trip_counts"] += ins.trip_count is None
            continue
        totals["launches"] += multiplier
        totals["top_level"] += 0 if in_loop else 1
        totals["custom_calls"] += multiplier if ins.opcode == "custom-call" else 0
        by_family[family(ins)] += multiplier
        by_layer[layer_of(ins)] += multiplier
    return Census(top_level_kernels=totals["top_level"], launches_per_call=totals["launches"],
                  custom_calls=totals["custom_calls"], while_loops=totals["while_loops"],
                  collectives=by_family["collectives"], by_family={f: by_family[f] for f in FAMILIES if by_family[f]},
                  by_layer_kind={k: by_layer[k] for k in LAYER_KINDS if by_layer[k]},
                  unknown_trip_counts=totals["unknown_trip_counts"])


def op_families(hlo_text: str) -> dict[str, str]:
    """Every instruction name of every computation -> its op family (to attribute profiler events by HLO op)."""
    return {name: fam for name, (fam, _) in op_sites(hlo_text).items()}


def op_sites(hlo_text: str) -> dict[str, tuple[str, str]]:
    """Every instruction name -> (its op family, its site): the model scope of its op_name without the program's
    name, and the kind of its HLO instruction (e.g. "window_layer/attention/fp8_matmul/reduce_max input_reduce"),
    so the same op of every layer of one kind shares a site."""
    computations, _ = parse(hlo_text)
    return {ins.name: (family(ins), _site(ins)) for instructions in computations.values() for ins in instructions}


def _site(instruction: Instruction) -> str:
    scope = instruction.op_name.split("/", 1)[1] if "/" in instruction.op_name else instruction.op_name
    kind = re.sub(r"(_fusion)?(\.\d+)*$", "", instruction.name)          # input_reduce_fusion.8 -> input_reduce
    return f"{scope} {kind}".strip()


_SHAPE = re.compile(r"^(?P<dtype>[a-z][a-z0-9]*)\[(?P<dims>[\d,]*)\](?:\{(?P<layout>[\d,]*))?")
_ITEM_BYTES = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2,
               "f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8}
SECTOR_BYTES = 32          # the unit a GPU reads memory in: a gather of single elements reads a sector for each


def _instruction_lines(hlo_text: str):
    """(computation, instruction name, the text after 'name = ', whether it is the computation's ROOT) for every
    instruction of every computation."""
    current = None
    for line in hlo_text.splitlines():
        m = _COMPUTATION.match(line)
        if m:
            current = m.group("name")
            continue
        m = _INSTRUCTION.match(line)
        if m and current is not None:
            yield current, m.group("name"), m.group("rest"), line.lstrip().startswith("ROOT")


def _array_shape(rest: str) -> tuple[str, list[int], list[int] | None] | None:
    """(dtype, dims, layout or None) of an instruction's array result from the text after 'name = '; None for a
    tuple."""
    shape = _SHAPE.match(rest)
    if not shape:
        return None
    layout = [int(d) for d in shape.group("layout").split(",") if d] if shape.group("layout") else None
    return shape.group("dtype"), [int(d) for d in shape.group("dims").split(",") if d], layout


def _elements(dims: list[int]) -> int:
    count = 1
    for d in dims:
        count *= d
    return count


def strided_gathers(hlo_text: str) -> list[dict]:
    """Gathers (at top level or inside fusions) whose slices are not contiguous in memory: each slice takes one
    element along the operand's minor-most dimension but several along another, so it reads elements that lie far
    apart, each costing a memory sector of its own (e.g. the rows of a [slots, N, columns] matmul output gathered
    back to row order). Per such gather: its op family, op_name, operand shape and layout, slice_sizes, and the
    bytes it uses against the bytes of the sectors it touches (an upper bound, no cache reuse)."""
    shapes: dict[tuple[str, str], tuple[str, list[int], list[int] | None]] = {}
    gathers = []
    for computation, name, rest, _ in _instruction_lines(hlo_text):
        shape = _array_shape(rest)
        if shape:
            shapes[(computation, name)] = shape
        if _opcode(rest) == "gather":
            gathers.append((computation, name, rest))
    found = []
    for computation, name, rest in gathers:
        operand = re.search(r"gather\(%?([^\s,)]+)", rest)
        sizes = re.search(r"slice_sizes=\{([\d,]*)\}", rest)
        if not operand or not sizes or (computation, operand.group(1)) not in shapes:
            continue
        dtype, dims, layout = shapes[(computation, operand.group(1))]
        slice_sizes = [int(d) for d in sizes.group(1).split(",") if d]
        if len(slice_sizes) != len(dims) or not dims:
            continue
        minor = layout[0] if layout else len(dims) - 1
        if dims[minor] == 1 or slice_sizes[minor] != 1 or max(slice_sizes) == 1:
            continue
        out = shapes.get((computation, name))
        elements = _elements(out[1]) if out else 1
        item = _ITEM_BYTES.get(dtype, 4)
        op_name = re.search(r'op_name="([^"]*)"', rest)
        op_name = op_name.group(1) if op_name else ""
        ins = Instruction(name, "gather", op_name, {}, None)
        found.append({"family": family(ins), "op_name": op_name, "operand": f"{dtype}{dims}",
                      "layout": layout, "slice_sizes": slice_sizes, "bytes_used": elements * item,
                      "bytes_read": elements * max(item, SECTOR_BYTES)})
    return found


def slice_copies(hlo_text: str, min_bytes: int = 64 * 2 ** 20) -> list[dict]:
    """Dynamic slices of at least `min_bytes` that a program writes out as buffers of their own: a computation
    (a fusion's, or the entry or a loop body) whose result is the slice, e.g. a scanned layer's weights taken out
    of their stack before a kernel that cannot read them in place. (A slice XLA hands to a custom call in place
    lies inside its `dynamic-slice-fusion`, whose result is the call's, and one that feeds arithmetic is fused
    into it; neither is listed.) Per copy: its op_name, the stack's shape, the slice's shape and bytes."""
    found = []
    types: dict[tuple[str, str], str] = {}           # each instruction's result type as written, without layout
    slices: dict[tuple[str, str], str] = {}          # the dynamic slices' text after 'name = '
    for computation, name, rest, root in _instruction_lines(hlo_text):
        types[(computation, name)] = re.sub(r"\{.*", "", rest.split(" ", 1)[0])
        opcode = _opcode(rest)
        if opcode == "dynamic-slice":
            slices[(computation, name)] = rest
        if not root:
            continue
        if opcode == "bitcast":
            source = re.search(r"bitcast\(%?([^\s,)]+)\)", rest)
            name = source.group(1) if source else ""
        text = slices.get((computation, name))
        shape = _array_shape(text) if text else None
        if shape is None:
            continue
        dtype, dims, _ = shape
        size = _ITEM_BYTES.get(dtype, 4) * _elements(dims)
        if size < min_bytes:
            continue
        op_name = re.search(r'op_name="([^"]*)"', text)
        operand = re.search(r"dynamic-slice\(%?([^\s,)]+)", text)
        operand = operand.group(1) if operand else ""
        found.append({"computation": computation, "op_name": op_name.group(1) if op_name else "",
                      "operand": types.get((computation, operand), operand), "slice": f"{dtype}{dims}",
                      "bytes": size})
    return found


def _type_bytes(type_text: str) -> int:
    """Bytes of every array in an instruction's result type (a tuple: all of its arrays)."""
    total = 0
    for dtype, dims in re.findall(r"\b([a-z][a-z0-9]*)\[([\d,]*)\]", type_text):
        if dtype in _ITEM_BYTES:
            total += _ITEM_BYTES[dtype] * _elements([int(d) for d in dims.split(",") if d])
    return total


def _operands(rest: str, opcode: str) -> list[str]:
    """The operand names of an instruction, from the parenthesised list after its opcode."""
    start = rest.find(opcode + "(")
    if start < 0:
        return []
    i, depth = start + len(opcode), 0
    for j in range(i, len(rest)):
        depth += rest[j] == "("
        depth -= rest[j] == ")"
        if depth == 0:
            return re.findall(r"%([^\s,)]+)", rest[i:j + 1])
    return []


def kernel_bytes(hlo_text: str, top: int = 20) -> dict:
    """What the kernels of a compiled program read and write, in bytes, from the sizes of their operands and results
    (an upper bound on each kernel's traffic: a gather or a dynamic slice may read part of an operand, and a kernel
    may find some of its input in L2). Loop bodies count once per iteration, as in `census`; an in-place
    dynamic-update-slice (a fusion of one) counts its update, not the buffer it writes into; an operand passed to
    one kernel twice (e.g. two halves of one array as two Pallas operands) counts once. Returns {"total",
    "by_family": {family: bytes}, "top_sites": the `top` sites (as `op_sites` names them, instances of one layer
    kind merged) with the most bytes: {"site", "family", "kernels", "bytes"}}. Compiled for a compile-only GPU, it
    compares two versions of a program without running either (docs/performance.md: the mHC sites' mix written
    out in float32)."""
    computations, entry = parse(hlo_text)
    types: dict[tuple[str, str], str] = {}
    operands: dict[tuple[str, str], list[str]] = {}
    for computation, name, rest, _ in _instruction_lines(hlo_text):
        types[(computation, name)] = rest.split(" ", 1)[0] if not rest.startswith("(") else rest[:rest.find(")") + 1]
        operands[(computation, name)] = _operands(rest, _opcode(rest))
    by_family: collections.Counter = collections.Counter()
    sites: dict[str, list] = {}

    for computation, ins, multiplier, _ in _walk(computations, entry):
        if ins.opcode == "while":
            continue
        names = operands[(computation, ins.name)]
        in_place = re.search(r"dynamic[-_]update[-_]slice", ins.name) is not None
        read = dict.fromkeys(names[1:] if in_place else names)         # an array passed twice is read once
        size = sum(_type_bytes(types.get((computation, n), "")) for n in read)
        if not in_place:
            size += _type_bytes(types[(computation, ins.name)])
        size *= multiplier
        fam = family(ins)
        by_family[fam] += size
        site = re.sub(r"^(window|csa|hca|mtp)_layer/", "<layer>/", _site(ins))
        entry_ = sites.setdefault(site, [fam, 0, 0])
        entry_[1] += multiplier
        entry_[2] += size
    ranked = sorted(sites.items(), key=lambda item: -item[1][2])[:top]
    return {"total": sum(by_family.values()),
            "by_family": {f: by_family[f] for f in FAMILIES if by_family[f]},
            "top_sites": [{"site": s, "family": f, "kernels": k, "bytes": b} for s, (f, k, b) in ranked]}
