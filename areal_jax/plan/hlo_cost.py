"""FLOPs and bytes of a compiled program, counting loop bodies once per iteration.

XLA's ``cost_analysis`` counts a ``while`` body once, whatever its trip count, so a
program whose layers are one ``lax.scan`` (or whose attention, logprob chunks or decode
steps are scans) reports a fraction of its work. This reads the optimised HLO text:

* FLOPs: 2 x output elements x contracted size for every ``dot`` and ``convolution``
  (inside fusions too; a convolution's window counts only the taps that can land on
  input elements, not padding or the holes of a base dilation) and cuBLAS gemm custom
  call;
* bytes: operands + outputs of every instruction outside fusions (a fusion reads its
  operands and writes its output once; what happens inside stays on chip), the
  ``cost_analysis`` model, where:
  - a (dynamic-)slice or gather moves what it returns (an embedding lookup does not read
    the table) and an in-place dynamic-update-slice its update (also inside a fusion,
    nested ones included: a loop step that reads one block of a buffer, or one layer of
    stacked weights, is not charged the whole buffer);
  - an asynchronous pair (``copy-start`` / ``copy-done``, ``collective-permute-start`` /
    ``-done``, ...) is charged once, at its start, for its operands and the new buffers
    its output tuple adds (the tuple repeats the operand);
  - a fusion's tuple elements that are its parameters passed through, or the collective
    of a TPU async collective fusion, are not charged (see ``_COLLECTIVES``);

each multiplied by the trip counts of the loops around it (XLA's ``known_trip_count``;
else the loop counter's: the condition compares a tuple element with a constant, the body
adds a constant step to it, the initial tuple gives its start, so a windowed einsum that
steps by 2 to 4 runs twice; else the one integer constant of the loop's condition); a
conditional counts its most expensive branch.
"""

from __future__ import annotations

import json
import re
from functools import cache

import numpy as np

_ITEMSIZE = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4,
             "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16,
             "f8e4m3fn": 1, "f8e5m2": 1, "s4": 1, "u4": 1}
_ARRAY = re.compile(r"\b([a-z]+\d*[a-z0-9]*)\[([\d,]*)\]")
_HEADER = re.compile(r"^(?:ENTRY )?%([\w.\-]+) .*\{$")
# Ops that read only the part of their first operand they return.
_PARTIAL_READS = {"dynamic-slice", "slice", "gather"}
# A collective inside a fusion is TPU's async collective fusion: the collective is
# progressed piece by piece across the compute fusions it is fused into (their
# ``continuation_config``), and each of them prints the whole collective.
_COLLECTIVES = {"all-gather", "all-reduce", "reduce-scatter", "collective-permute",
                "all-to-all"}
_NO_TRAFFIC = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "while",
               "call", "conditional", "after-all", "partition-id", "replica-id"}


def _arrays(type_text: str) -> list[tuple[str, tuple[int, ...]]]:
    return [(d, tuple(int(x) for x in dims.split(",") if x))
            for d, dims in _ARRAY.findall(type_text) if d in _ITEMSIZE]


def _nbytes(type_text: str) -> int:
    return sum(int(np.prod(s)) * _ITEMSIZE[d] for d, s in _arrays(type_text))


def _closing(text: str, start: int) -> int:
    """The index of the parenthesis closing the one at ``text[start]``."""
    depth = 0
    for i in range(start, len(text)):
        depth += text[i] == "("
        depth -= text[i] == ")"
        if depth == 0:
            return i
    return len(text) - 1


def _split_instruction(line: str) -> tuple[str, str, str, list[str], str] | None:
    """(name, result type, opcode, operand names, attributes) of an HLO instruction line."""
    m = re.match(r"^\s*(?:ROOT )?%([\w.\-]+) = ", line)
    if m is None:
        return None
    rest = line[m.end():]
    if rest.startswith("("):  # a tuple type
        end = _closing(rest, 0)
        type_text, rest = rest[:end + 1], rest[end + 2:]
    else:
        type_text, _, rest = rest.partition(" ")
    op = re.match(r"([\w\-]+)\(", rest)
    if op is None:
        return None
    end = _closing(rest, op.end() - 1)
    operands = re.findall(r"%([\w.\-]+)", rest[op.end() - 1:end + 1])
    return m.group(1), type_text, op.group(1), operands, rest[end + 1:]


def _dims(attrs: str, key: str) -> list[int]:
    m = re.search(key + r"=\{([\d,]*)\}", attrs)
    return [int(x) for x in m.group(1).split(",") if x] if m else []


def _dot_flops(out_type: str, lhs_type: str, contracting: list[int]) -> float:
    out, lhs = _arrays(out_type), _arrays(lhs_type)
    if not out or not lhs:
        return 0.0
    k = int(np.prod([lhs[0][1][d] for d in contracting])) if contracting else 1
    return 2.0 * float(np.prod(out[0][1])) * k


def _conv_flops(out_type: str, rhs_type: str, attrs: str, lhs_type: str = "") -> float:
    m = re.search(r"dim_labels=(\w*)_(\w+)->", attrs)
    out, rhs, lhs = _arrays(out_type), _arrays(rhs_type), _arrays(lhs_type)
    if m is None or not out or not rhs:
        return 0.0
    lhs_labels, labels, shape = m.group(1), m.group(2), rhs[0][1]
    # Only window taps that can land on an input element do work. TPU lowers batched and
    # small matmuls to convolutions whose windows mostly cover padding or the holes of a
    # base dilation: a batched attention product is a size-64 window with lhs_dilate=64
    # (one real element per output), a [64, 1536] x [1536, 12, 128] projection a size-12
    # window, padded 11 each side, over a spatial extent of 1. A spatial dimension of the
    # window then contributes at most ceil(window / lhs_dilate) taps, and at most the
    # input's extent.
    dilate = re.search(r"lhs_dilate=([\dx]+)", attrs)
    lhs_dilate = [int(d) for d in dilate.group(1).split("x")] if dilate else []
    extent = {label: lhs[0][1][i] for i, label in enumerate(lhs_labels)
              if label.isdigit() and lhs and i < len(lhs[0][1])}
    k = 1
    for i, label in enumerate(labels):
        if label == "i":
            k *= shape[i]
        elif label.isdigit():
            d = int(label)
            taps = -(-shape[i] // lhs_dilate[d]) if d < len(lhs_dilate) else shape[i]
            k *= min(taps, extent.get(label, taps))
    return 2.0 * float(np.prod(out[0][1])) * k


def hlo_cost(hlo_text: str) -> dict[str, float]:
    """{"flops", "bytes_accessed"} of the entry computation of ``hlo_text`` (one device's
    program), loops counted per iteration."""
    comps: dict[str, list[str]] = {}
    entry, current = None, None
    for line in hlo_text.splitlines():
        header = _HEADER.match(line)
        if header:
            current = header.group(1)
            comps[current] = []
            if line.startswith("ENTRY"):
                entry = current
        elif line.rstrip() == "}":  # not "}}, metadata=...", the tail of a multi-line kernel config
            current = None
        elif current is not None:
            comps[current].append(line)
    parsed: dict[str, list] = {}
    insts: dict[str, dict[str, tuple]] = {}  # computation -> {instruction name: parsed}
    consts: dict[str, dict[str, int]] = {}  # computation -> {name: value} of int constants
    roots: dict[str, tuple] = {}  # computation -> its ROOT instruction
    param_index: dict[str, dict[str, int]] = {}  # computation -> {parameter name: index}
    for name, lines in comps.items():
        parsed[name], insts[name], consts[name], param_index[name] = [], {}, {}, {}
        for line in lines:
            ins = _split_instruction(line)
            if ins is None:
                continue
            parsed[name].append(ins)
            insts[name][ins[0]] = ins
            if ins[2] == "constant":
                value = re.search(r"constant\((-?\d+)\)", line)
                if value:
                    consts[name][ins[0]] = int(value.group(1))
            if line.lstrip().startswith("ROOT"):
                roots[name] = ins
            if ins[2] == "parameter":
                param_index[name][ins[0]] = int(re.match(r"parameter\((\d+)", line[
                    line.index("parameter("):]).group(1))
    fused = {m for ins in parsed.values() for _, _, op, _, attrs in ins if op == "fusion"
             for m in re.findall(r"calls=%([\w.\-]+)", attrs)}

    def induction(cond: str, body: str, init: str | None, caller: str) -> int | None:
        """Trip count from the loop's counter: the condition compares tuple element k
        with a constant N, the body's root sets element k to itself plus a constant
        step, the loop's initial tuple holds its start (a constant, else 0). XLA's
        windowed einsums step their counter by 2 (two shards an iteration)."""
        root = roots.get(cond)
        if root is None or root[2] != "compare" or len(root[3]) != 2:
            return None
        k = limit = None
        for side, other in (root[3], root[3][::-1]):
            g = insts[cond].get(side)
            c = consts[cond].get(other)
            if g is not None and g[2] == "get-tuple-element" and c is not None:
                k, limit = int(re.search(r"index=(\d+)", g[4]).group(1)), c
                swapped = side != root[3][0]
                break
        if k is None:
            return None
        direction = re.search(r"direction=(\w+)", root[4])
        direction = direction.group(1) if direction else "LT"
        if swapped:  # N > i is i < N
            direction = {"GT": "LT", "GE": "LE", "LT": "GT", "LE": "GE"}.get(direction, direction)
        step, start = 1, 0
        broot = roots.get(body)
        if broot is not None and broot[2] == "tuple" and k < len(broot[3]):
            upd = insts.get(body, {}).get(broot[3][k])
            if upd is not None and upd[2] == "add":
                steps = [consts[body][o] for o in upd[3] if o in consts[body]]
                if len(steps) == 1:
                    step = steps[0]
        tup = insts[caller].get(init) if init else None
        if tup is not None and tup[2] == "tuple" and k < len(tup[3]):
            start = consts[caller].get(tup[3][k], 0)
        if step <= 0 or direction not in ("LT", "LE"):
            return None
        span = limit - start + (1 if direction == "LE" else 0)
        return max(0, -(-span // step))

    def trip_count(attrs: str, operands: list[str], caller: str) -> int:
        m = re.search(r'known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"(\d+)"', attrs)
        if m:
            return int(m.group(1))
        cond = re.search(r"condition=%([\w.\-]+)", attrs)
        body = re.search(r"body=%([\w.\-]+)", attrs)
        if cond and body and cond.group(1) in parsed:
            n = induction(cond.group(1), body.group(1), operands[0] if operands else None,
                          caller)
            if n is not None:
                return n
        limits = set(consts.get(cond.group(1), {}).values()) if cond else set()
        limits.discard(0)
        return limits.pop() if len(limits) == 1 else 1

    @cache
    def fusion_io(name: str) -> tuple[dict[int, int], int | None]:
        """What a fusion really moves: {parameter index: bytes read} for parameters read
        only through slices or gathers (those, not the whole buffer), and the bytes
        written when its root is an in-place dynamic-update-slice (the update; the
        buffer operand is then not read either) or a tuple. Of a tuple, an element that
        is a parameter passed through (aliased to its operand) is neither read nor
        written, and neither is the collective of an async collective fusion (see
        ``_COLLECTIVES``): on TPU such a fusion passes the gathered buffer and a dozen
        flags through, and charging them made every layer of a scanned 0.5B forward
        pass read and write its 272 MB output matrix six times."""
        ins = parsed.get(name, [])
        types = {n: t for n, t, _, _, _ in ins}
        params = param_index.get(name, {})
        users: dict[str, list[tuple[str, str, int, str]]] = {n: [] for n in params}
        for _, out_type, op, operands, attrs in ins:
            for pos, o in enumerate(operands):
                if o in users:
                    users[o].append((op, out_type, pos, attrs))

        def partial_read(op: str, out_type: str, pos: int, attrs: str) -> int | None:
            """Bytes a use reads of its operand ``pos`` if only a part of it, else None. A
            nested fusion (TPU fuses a loop step's slice of stacked weights into a fusion
            inside the matmul's) reads what its own parameter's uses read."""
            if op in _PARTIAL_READS and pos == 0:
                return _nbytes(out_type)
            if op == "fusion":
                m = re.search(r"calls=%([\w.\-]+)", attrs)
                return fusion_io(m.group(1))[0].get(pos) if m else None
            return None

        reads = {}
        for pname, index in params.items():
            parts = [partial_read(*use) for use in users[pname]]
            if parts and all(part is not None for part in parts):
                reads[index] = sum(parts)
        written = None
        root = roots.get(name)
        if root is not None and root[2] == "dynamic-update-slice" and len(root[3]) > 1:
            written = _nbytes(types.get(root[3][1], ""))
            if root[3][0] in params:
                reads[params[root[3][0]]] = 0
        elif root is not None and root[2] == "tuple":
            free = [o in params or insts[name].get(o, ("", "", ""))[2] in _COLLECTIVES
                    for o in root[3]]
            if any(free):
                written = sum(_nbytes(types.get(o, "")) for o, f in zip(root[3], free, strict=True)
                              if not f)
                for pname, index in params.items():
                    uses = users[pname]
                    if uses and all(op == "tuple" or op in _COLLECTIVES
                                    for op, _, _, _ in uses):
                        reads[index] = 0
        return reads, written

    def traffic_of(out_type: str, op: str, operands: list[str], attrs: str,
                   types: dict[str, str]) -> float:
        if op.endswith("-done"):  # its "-start" was charged the move
            return 0.0
        if op.endswith("-start"):  # reads its operands, writes what its tuple adds to them
            read = sum(_nbytes(types.get(o, "")) for o in operands)
            return float(read + max(_nbytes(out_type) - read, 0))
        if op in _PARTIAL_READS:
            return 2.0 * _nbytes(out_type)
        if op == "dynamic-update-slice" and len(operands) > 1:
            return 2.0 * _nbytes(types.get(operands[1], ""))
        reads, written = {}, None
        if op == "fusion":
            m = re.search(r"calls=%([\w.\-]+)", attrs)
            if m:
                reads, written = fusion_io(m.group(1))
        total = _nbytes(out_type) if written is None else written
        for i, o in enumerate(operands):
            total += reads.get(i, _nbytes(types.get(o, "")))
        return float(total)

    @cache
    def cost(name: str) -> tuple[float, float]:
        types = {n: t for n, t, _, _, _ in parsed.get(name, [])}
        flops = traffic = 0.0
        for _, out_type, op, operands, attrs in parsed.get(name, []):
            if op == "dot" and operands:
                flops += _dot_flops(out_type, types.get(operands[0], ""),
                                    _dims(attrs, "lhs_contracting_dims"))
            elif op == "convolution" and len(operands) > 1:
                flops += _conv_flops(out_type, types.get(operands[1], ""), attrs,
                                     types.get(operands[0], ""))
            elif op == "custom-call" and "__cublas" in attrs and operands:
                m = re.search(r'"lhs_contracting_dimensions"\s*:\s*\[([^\]]*)\]', attrs)
                dims = [int(x) for x in json.loads(f"[{m.group(1)}]")] if m else []
                flops += _dot_flops(out_type, types.get(operands[0], ""), dims)
            if name not in fused and op not in _NO_TRAFFIC:
                traffic += traffic_of(out_type, op, operands, attrs, types)
            if op == "while":
                n = trip_count(attrs, operands, name)
                for key in ("body", "condition"):
                    m = re.search(key + r"=%([\w.\-]+)", attrs)
                    if m:
                        f, t = cost(m.group(1))
                        flops, traffic = flops + n * f, traffic + n * t
            elif op == "conditional":
                branches = re.findall(r"%([\w.\-]+)", (re.search(
                    r"branch_computations=\{([^}]*)\}", attrs) or re.search(
                    r"(true_computation=%[\w.\-]+, false_computation=%[\w.\-]+)", attrs)
                    or re.search(r"()", "")).group(1))
                if branches:
                    f, t = max((cost(b) for b in branches), key=lambda c: c[0])
                    flops, traffic = flops + f, traffic + t
            elif op in ("fusion", "call", "async-start") or (
                    op == "custom-call" and "calls=" in attrs):
                for m in re.findall(r"calls=%([\w.\-]+)", attrs):
                    f, t = cost(m)
                    flops, traffic = flops + f, traffic + t
        return flops, traffic

    if entry is None:
        return {"flops": 0.0, "bytes_accessed": 0.0}
    flops, traffic = cost(entry)
    return {"flops": flops, "bytes_accessed": traffic}
