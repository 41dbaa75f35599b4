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

The text is parsed once into an ``HloModule`` of ``Computation``s of ``Instruction``s
(named fields, not positional tuples); ``HloCost`` walks it, one method per rule above.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

_ITEMSIZE = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4,
             "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16,
             "f8e4m3fn": 1, "f8e5m2": 1, "s4": 1, "u4": 1}
_ARRAY = re.compile(r"\b([a-z]+\d*[a-z0-9]*)\[([\d,]*)\]")
_HEADER = re.compile(r"^(?:ENTRY )?%([\w.\-]+) .*\{$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = ")
_NAME = r"%([\w.\-]+)"
# Ops that read only the part of their first operand they return.
_PARTIAL_READS = {"dynamic-slice", "slice", "gather"}
# A collective inside a fusion is TPU's async collective fusion: the collective is
# progressed piece by piece across the compute fusions it is fused into (their
# ``continuation_config``), and each of them prints the whole collective.
_COLLECTIVES = {"all-gather", "all-reduce", "reduce-scatter", "collective-permute",
                "all-to-all"}
_NO_TRAFFIC = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "while",
               "call", "conditional", "after-all", "partition-id", "replica-id"}
# The condition's comparison read with the counter on the left: N > i is i < N.
_SWAPPED = {"GT": "LT", "GE": "LE", "LT": "GT", "LE": "GE"}


# ------------------------------------------------------------------ types and products
def _arrays(type_text: str) -> list[tuple[str, tuple[int, ...]]]:
    """(dtype, shape) of each array in a (tuple) type, e.g. ``(s32[], f32[8,8])``."""
    return [(d, tuple(int(x) for x in dims.split(",") if x))
            for d, dims in _ARRAY.findall(type_text) if d in _ITEMSIZE]


def _nbytes(type_text: str) -> int:
    return sum(int(np.prod(s)) * _ITEMSIZE[d] for d, s in _arrays(type_text))


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


# ------------------------------------------------------------------ the parsed module
def _closing(text: str, start: int) -> int:
    """The index of the parenthesis closing the one at ``text[start]``."""
    depth = 0
    for i in range(start, len(text)):
        depth += text[i] == "("
        depth -= text[i] == ")"
        if depth == 0:
            return i
    return len(text) - 1


@dataclass(frozen=True)
class Instruction:
    """One HLO instruction line: ``[ROOT] %name = TYPE opcode(%operand, ...)ATTRS``."""

    name: str
    type_text: str  # the result type: ``f32[8,8]``, or a tuple ``(s32[], f32[8,8])``
    opcode: str
    operands: tuple[str, ...]
    attrs: str  # everything after the operand list (dimensions, calls=, metadata, ...)
    is_root: bool = False
    constant: int | None = None  # the value of an integer constant
    parameter: int | None = None  # the index of a parameter

    @classmethod
    def parse(cls, line: str) -> Instruction | None:
        """The instruction on ``line``, or None where the line holds none."""
        m = _INSTRUCTION.match(line)
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
        opcode = op.group(1)
        constant = parameter = None
        if opcode == "constant":
            value = re.search(r"constant\((-?\d+)\)", line)
            constant = int(value.group(1)) if value else None
        elif opcode == "parameter":
            index = re.match(r"parameter\((\d+)", line[line.index("parameter("):])
            parameter = int(index.group(1)) if index else None
        return cls(name=m.group(1), type_text=type_text, opcode=opcode,
                   operands=tuple(re.findall(_NAME, rest[op.end() - 1:end + 1])),
                   attrs=rest[end + 1:], is_root=line.lstrip().startswith("ROOT"),
                   constant=constant, parameter=parameter)

    def attr(self, key: str) -> str | None:
        """The computation an attribute names (``body=%b`` -> ``b``), else None."""
        m = re.search(key + "=" + _NAME, self.attrs)
        return m.group(1) if m else None

    def called(self) -> list[str]:
        """Every computation named by a ``calls=`` attribute."""
        return re.findall("calls=" + _NAME, self.attrs)


@dataclass
class Computation:
    """One computation: its instructions in order, and lookups by name."""

    name: str
    instructions: list[Instruction] = field(default_factory=list)
    by_name: dict[str, Instruction] = field(default_factory=dict)
    constants: dict[str, int] = field(default_factory=dict)  # integer constants by name
    parameters: dict[str, int] = field(default_factory=dict)  # parameter name -> index
    root: Instruction | None = None

    def add(self, ins: Instruction) -> None:
        self.instructions.append(ins)
        self.by_name[ins.name] = ins
        if ins.constant is not None:
            self.constants[ins.name] = ins.constant
        if ins.is_root:
            self.root = ins
        if ins.parameter is not None:
            self.parameters[ins.name] = ins.parameter

    def type_of(self, name: str) -> str:
        """The result type of instruction ``name`` ("" if it is not one of these)."""
        ins = self.by_name.get(name)
        return ins.type_text if ins is not None else ""

    def opcode_of(self, name: str) -> str:
        ins = self.by_name.get(name)
        return ins.opcode if ins is not None else ""


@dataclass
class HloModule:
    """The computations of an optimised HLO module's text, and which is the entry."""

    computations: dict[str, Computation]
    entry: str | None
    fused: frozenset[str]  # computations that are the body of a fusion

    @classmethod
    def parse(cls, hlo_text: str) -> HloModule:
        lines: dict[str, list[str]] = {}
        entry, current = None, None
        for line in hlo_text.splitlines():
            header = _HEADER.match(line)
            if header:
                current = header.group(1)
                lines[current] = []
                if line.startswith("ENTRY"):
                    entry = current
            elif line.rstrip() == "}":  # not "}}, metadata=...", the tail of a kernel config
                current = None
            elif current is not None:
                lines[current].append(line)
        computations = {}
        for name, body in lines.items():
            comp = computations[name] = Computation(name)
            for line in body:
                ins = Instruction.parse(line)
                if ins is not None:
                    comp.add(ins)
        fused = frozenset(callee for comp in computations.values()
                          for ins in comp.instructions if ins.opcode == "fusion"
                          for callee in ins.called())
        return cls(computations, entry, fused)

    def get(self, name: str) -> Computation:
        """Computation ``name``; an empty one for a name the text does not define."""
        comp = self.computations.get(name)
        return comp if comp is not None else Computation(name)


# ------------------------------------------------------------------ the cost
@dataclass
class FusionIO:
    """What a fusion really moves, where it is not its operands and output: bytes read of
    some parameters (by index), and bytes written (None: its output type's size)."""

    reads: dict[int, int] = field(default_factory=dict)
    written: int | None = None


class HloCost:
    """FLOPs and bytes of each computation of a module, callees and loops included."""

    def __init__(self, module: HloModule) -> None:
        self.module = module
        self._costs: dict[str, tuple[float, float]] = {}
        self._fusion_io: dict[str, FusionIO] = {}

    def entry_cost(self) -> dict[str, float]:
        """{"flops", "bytes_accessed"} of the entry computation (0 without one)."""
        if self.module.entry is None:
            return {"flops": 0.0, "bytes_accessed": 0.0}
        flops, traffic = self.cost(self.module.entry)
        return {"flops": flops, "bytes_accessed": traffic}

    def cost(self, name: str) -> tuple[float, float]:
        """(FLOPs, bytes) of computation ``name``: its own instructions' and, per call,
        those of the computations they call (a loop's body and condition per iteration)."""
        if name not in self._costs:
            comp = self.module.get(name)
            counts_traffic = name not in self.module.fused
            flops = traffic = 0.0
            for ins in comp.instructions:
                flops += self.flops(ins, comp)
                if counts_traffic and ins.opcode not in _NO_TRAFFIC:
                    traffic += self.traffic(ins, comp)
                for times, callee in self.callees(ins, comp):
                    f, t = self.cost(callee)
                    flops, traffic = flops + times * f, traffic + times * t
            self._costs[name] = (flops, traffic)
        return self._costs[name]

    @staticmethod
    def flops(ins: Instruction, comp: Computation) -> float:
        """The matrix products' FLOPs of one instruction (0 for any other op)."""
        if ins.opcode == "dot" and ins.operands:
            return _dot_flops(ins.type_text, comp.type_of(ins.operands[0]),
                              _dims(ins.attrs, "lhs_contracting_dims"))
        if ins.opcode == "convolution" and len(ins.operands) > 1:
            return _conv_flops(ins.type_text, comp.type_of(ins.operands[1]), ins.attrs,
                               comp.type_of(ins.operands[0]))
        if ins.opcode == "custom-call" and "__cublas" in ins.attrs and ins.operands:
            m = re.search(r'"lhs_contracting_dimensions"\s*:\s*\[([^\]]*)\]', ins.attrs)
            dims = [int(x) for x in json.loads(f"[{m.group(1)}]")] if m else []
            return _dot_flops(ins.type_text, comp.type_of(ins.operands[0]), dims)
        return 0.0

    def callees(self, ins: Instruction, comp: Computation) -> Iterator[tuple[int, str]]:
        """(times, computation) for each computation ``ins`` runs: a loop's body and
        condition its trip count times, a conditional's most expensive branch (by FLOPs),
        a fusion's, call's or kernel's computations once."""
        if ins.opcode == "while":
            n = self.trip_count(ins, comp)
            for key in ("body", "condition"):
                callee = ins.attr(key)
                if callee is not None:
                    yield n, callee
        elif ins.opcode == "conditional":
            branches = _branches(ins.attrs)
            if branches:
                yield 1, max(branches, key=lambda b: self.cost(b)[0])
        elif ins.opcode in ("fusion", "call", "async-start") or (
                ins.opcode == "custom-call" and "calls=" in ins.attrs):
            for callee in ins.called():
                yield 1, callee

    # -------------------------------------------------------------- trip counts
    def trip_count(self, loop: Instruction, caller: Computation) -> int:
        """XLA's ``known_trip_count``, else the loop counter's (``counter_trips``), else
        the one nonzero integer constant of the condition, else 1."""
        m = re.search(r'known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"(\d+)"', loop.attrs)
        if m:
            return int(m.group(1))
        cond, body = loop.attr("condition"), loop.attr("body")
        if cond is not None and body is not None and cond in self.module.computations:
            n = self.counter_trips(cond, body, loop.operands[0] if loop.operands else None,
                                   caller)
            if n is not None:
                return n
        limits = set(self.module.get(cond).constants.values()) if cond is not None else set()
        limits.discard(0)
        return limits.pop() if len(limits) == 1 else 1

    def counter_trips(self, cond_name: str, body_name: str, init: str | None,
                      caller: Computation) -> int | None:
        """Trip count from the loop's counter: the condition compares tuple element k
        with a constant N, the body's root sets element k to itself plus a constant
        step, the loop's initial tuple holds its start (a constant, else 0). XLA's
        windowed einsums step their counter by 2 (two shards an iteration)."""
        counter = _counter_limit(self.module.get(cond_name))
        if counter is None:
            return None
        k, limit, direction = counter
        step, start = 1, 0
        body = self.module.get(body_name)
        if body.root is not None and body.root.opcode == "tuple" and k < len(body.root.operands):
            upd = body.by_name.get(body.root.operands[k])
            if upd is not None and upd.opcode == "add":
                steps = [body.constants[o] for o in upd.operands if o in body.constants]
                if len(steps) == 1:
                    step = steps[0]
        tup = caller.by_name.get(init) if init else None
        if tup is not None and tup.opcode == "tuple" and k < len(tup.operands):
            start = caller.constants.get(tup.operands[k], 0)
        if step <= 0 or direction not in ("LT", "LE"):
            return None
        span = limit - start + (1 if direction == "LE" else 0)
        return max(0, -(-span // step))

    # -------------------------------------------------------------- bytes
    def traffic(self, ins: Instruction, comp: Computation) -> float:
        """Bytes one instruction outside fusions moves (see the module's docstring)."""
        op, operands = ins.opcode, ins.operands
        if op.endswith("-done"):  # its "-start" was charged the move
            return 0.0
        if op.endswith("-start"):  # reads its operands, writes what its tuple adds to them
            read = sum(_nbytes(comp.type_of(o)) for o in operands)
            return float(read + max(_nbytes(ins.type_text) - read, 0))
        if op in _PARTIAL_READS:
            return 2.0 * _nbytes(ins.type_text)
        if op == "dynamic-update-slice" and len(operands) > 1:
            return 2.0 * _nbytes(comp.type_of(operands[1]))
        io = FusionIO()
        if op == "fusion":
            callee = ins.attr("calls")
            if callee is not None:
                io = self.fusion_io(callee)
        total = _nbytes(ins.type_text) if io.written is None else io.written
        for i, o in enumerate(operands):
            total += io.reads.get(i, _nbytes(comp.type_of(o)))
        return float(total)

    def fusion_io(self, name: str) -> FusionIO:
        """What fusion ``name`` really moves: {parameter index: bytes read} for parameters
        read only through slices or gathers (those, not the whole buffer), and the bytes
        written when its root is an in-place dynamic-update-slice (the update; the
        buffer operand is then not read either) or a tuple. Of a tuple, an element that
        is a parameter passed through (aliased to its operand) is neither read nor
        written, and neither is the collective of an async collective fusion (see
        ``_COLLECTIVES``): on TPU such a fusion passes the gathered buffer and a dozen
        flags through, and charging them made every layer of a scanned 0.5B forward
        pass read and write its 272 MB output matrix six times."""
        if name not in self._fusion_io:
            comp = self.module.get(name)
            users = _parameter_uses(comp)
            io = FusionIO()
            for pname, index in comp.parameters.items():
                parts = [self.partial_read(use, pos) for use, pos in users[pname]]
                if parts and all(part is not None for part in parts):
                    io.reads[index] = sum(part for part in parts if part is not None)
            root = comp.root
            if root is not None and root.opcode == "dynamic-update-slice" \
                    and len(root.operands) > 1:
                io.written = _nbytes(comp.type_of(root.operands[1]))
                if root.operands[0] in comp.parameters:
                    io.reads[comp.parameters[root.operands[0]]] = 0
            elif root is not None and root.opcode == "tuple":
                _pass_through(comp, root, users, io)
            self._fusion_io[name] = io
        return self._fusion_io[name]

    def partial_read(self, use: Instruction, pos: int) -> int | None:
        """Bytes ``use`` reads of its operand ``pos`` if only a part of it, else None. A
        nested fusion (TPU fuses a loop step's slice of stacked weights into a fusion
        inside the matmul's) reads what its own parameter's uses read."""
        if use.opcode in _PARTIAL_READS and pos == 0:
            return _nbytes(use.type_text)
        if use.opcode == "fusion":
            callee = use.attr("calls")
            return self.fusion_io(callee).reads.get(pos) if callee is not None else None
        return None


def _branches(attrs: str) -> list[str]:
    """The computations a conditional chooses between."""
    m = (re.search(r"branch_computations=\{([^}]*)\}", attrs)
         or re.search(r"(true_computation=%[\w.\-]+, false_computation=%[\w.\-]+)", attrs))
    return re.findall(_NAME, m.group(1)) if m else []


def _counter_limit(cond: Computation) -> tuple[int, int, str] | None:
    """(tuple index k of the counter, the constant N it is compared with, the comparison
    with the counter on the left) of a loop condition whose root compares a
    get-tuple-element with a constant, else None."""
    root = cond.root
    if root is None or root.opcode != "compare" or len(root.operands) != 2:
        return None
    for side, other in (root.operands, root.operands[::-1]):
        gte = cond.by_name.get(side)
        limit = cond.constants.get(other)
        index = re.search(r"index=(\d+)", gte.attrs) if gte is not None else None
        if gte is not None and gte.opcode == "get-tuple-element" and limit is not None \
                and index is not None:
            m = re.search(r"direction=(\w+)", root.attrs)
            direction = m.group(1) if m else "LT"
            if side != root.operands[0]:
                direction = _SWAPPED.get(direction, direction)
            return int(index.group(1)), limit, direction
    return None


def _parameter_uses(comp: Computation) -> dict[str, list[tuple[Instruction, int]]]:
    """Parameter name -> (instruction, operand position) of each use of it."""
    users: dict[str, list[tuple[Instruction, int]]] = {n: [] for n in comp.parameters}
    for ins in comp.instructions:
        for pos, o in enumerate(ins.operands):
            if o in users:
                users[o].append((ins, pos))
    return users


def _pass_through(comp: Computation, root: Instruction,
                  users: dict[str, list[tuple[Instruction, int]]], io: FusionIO) -> None:
    """A fusion whose root is a tuple: elements that are parameters passed through, or
    collectives, are not written, and parameters used only by them are not read."""
    free = [o in comp.parameters or comp.opcode_of(o) in _COLLECTIVES for o in root.operands]
    if not any(free):
        return
    io.written = sum(_nbytes(comp.type_of(o))
                     for o, f in zip(root.operands, free, strict=True) if not f)
    for pname, index in comp.parameters.items():
        uses = users[pname]
        if uses and all(use.opcode == "tuple" or use.opcode in _COLLECTIVES
                        for use, _ in uses):
            io.reads[index] = 0


def hlo_cost(hlo_text: str) -> dict[str, float]:
    """{"flops", "bytes_accessed"} of the entry computation of ``hlo_text`` (one device's
    program), loops counted per iteration."""
    return HloCost(HloModule.parse(hlo_text)).entry_cost()
