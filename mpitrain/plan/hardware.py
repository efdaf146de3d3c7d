"""The hardware catalogue: the devices and links the planner predicts for, as data, read
and checked field by field.

The catalogue is ``hardware.toml`` beside this file, each entry citing its source: devices'
memory, memory bandwidth and peak FLOP/s per precision (dense, as datasheets publish them);
links in Hockney's model (Parallel Computing 20, 1994: ``n`` bytes in one message take
``alpha + n / bandwidth``); the course notes' peaks. A user's file ($MPITRAIN_HARDWARE, else
~/.config/mpitrain/hardware.toml) replaces entries by key. Measuring this machine and
writing that file is :mod:`mpitrain.plan.calibrate`'s part.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from mpitrain.config.fields import ConfigError
from mpitrain.cost import matmul_flops
from mpitrain.plan.gpu import gemm_seconds

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

SHIPPED = Path(__file__).with_name("hardware.toml")
USER_ENV = "MPITRAIN_HARDWARE"
PRECISIONS = ("fp64", "fp32", "tf32", "bf16", "fp16", "fp8")
# a dtype's (or a precision's) name -> the precision whose peak a published device applies
PRECISION_OF = {"float64": "fp64", "float32": "fp32", "bfloat16": "bf16", "float16": "fp16",
                **{p: p for p in PRECISIONS}}
GEMM_DTYPES = ("float32", "float64")  # what calibration measures: half-precision products run in float32 here
CALIBRATED = ("gemm_gflops", "elementwise_bandwidth_gbs", "op_overhead_us")  # one of them: all of them
# the ways mpitrain's models run whose steps a device may have measured (passes, layer overhead): the GPT's
# blocks fused, op by op through tensor slicing's layers (and with sequence parallelism), op by op on the
# plain path (and with backward in a zero-bubble schedule's two passes); the CNNs
FAMILIES = ("gpt", "gpt-sliced", "gpt-sequence", "gpt-plain", "gpt-split", "cnn")
MIXED = ("bf16", "fp16")  # the mixed precisions whose cost per parameter a device may have measured
DEVICE_FIELDS = ("name", "memory_gb", "memory_bandwidth_gbs", "peak_flops", *CALIBRATED, "passes", "layer_overhead_us",
                 "step_overhead_us", "mixed_ns_per_parameter", "cast_ns_per_number", "switch_us", "objects_kb",
                 "objects_kb_per_array", "sustained_flops", "sms", "memory_bound_gbs",
                 "achievable_flops", "intra", "pair")
LINK_FIELDS = ("name", "alpha_us", "bandwidth_gbs", "achieved_gbs", "per_node", "overlap")


def emulated_link(rate_bits: float) -> str:
    """The catalogue's key of the link of ``mpitrain cluster`` calibrated at ``rate_bits``
    bits/s (``mpitrain plan --calibrate``): 1e9 is ``emu-1g``, 2.5e9 ``emu-2.5g``."""
    return f"emu-{rate_bits / 1e9:g}g"


OVERLAPPED = ("allreduce", "allgather", "reduce_scatter")  # the nonblocking collectives that run beside compute

class HardwareError(ConfigError):
    """A catalogue that cannot be used; ``str()`` names the file and the field, in one line
    (an input's error, as a config's: every command says it in one line, exit 2)."""


@dataclass(frozen=True)
class Device:
    key: str
    name: str
    memory_bytes: float  # memory_gb * 1e9
    memory_bandwidth: float  # bytes/s
    peak_flops: dict  # precision -> FLOP/s
    gemm: tuple = ()  # calibrated: ((m, k, n, dtype, FLOP/s, BLAS threads), ...)
    elementwise_bandwidth: float = 0.0  # bytes/s of a streaming op, read + write; published: memory_bandwidth
    op_overhead_s: float = 0.0  # a tiny op and its Python call
    calibrated: bool = False
    # family (FAMILIES) -> mpitrain's elementwise work of a training step (norms, softmax,
    # activations, im2col, the optimizer) beyond its GEMMs that grows with the batch, in passes
    # over the layers' traffic at elementwise_bandwidth (mpitrain.plan.steps.measure_steps); optional
    passes: dict = field(default_factory=dict)
    # family -> seconds per layer and micro-batch that do not grow with the batch (Python, each op's
    # call), and per layer and step (the update's calls per tensor); optional
    layer_overhead: dict = field(default_factory=dict)
    step_overhead: dict = field(default_factory=dict)
    # precision ("bf16", "fp16") -> seconds per parameter and micro-batch that mixed precision adds to a
    # float32 step (casts, the masters' update; steps.measure_mixed); optional
    mixed: dict = field(default_factory=dict)
    # precision -> seconds per number of a half array's round trip through float32 (a bucket's sum); optional
    cast: dict = field(default_factory=dict)
    # seconds a blocking call adds between two ranks that take turns on one core (probes.turns); optional
    switch: float = 0.0
    # bytes a training process holds at rest in Python's own objects (modules, parameters, the arrays'
    # headers, the run's records) beyond its arrays: ``objects`` and ``objects_per_array`` for each
    # parameter array it trains (calibrate.measure_objects); optional, none on a published device (host memory)
    objects: float = 0.0
    objects_per_array: float = 0.0
    # precision -> FLOP/s a device sustains as published (the course notes' figures; each cites its source in
    # the catalogue); optional, printed, and a GPU's products' rate where none was measured (achievable)
    sustained: dict = field(default_factory=dict)
    # a GPU's streaming multiprocessors (AMD: compute units), whose waves its products run in, the
    # bandwidth a memory-bound kernel achieves (bytes/s), and per precision the FLOP/s the fastest product
    # shape achieves as measured: the GPU model's (mpitrain.plan.gpu); optional
    sms: int = 0
    stream_bandwidth: float = 0.0
    achievable: dict = field(default_factory=dict)
    # the links (their catalogue keys) joining a node's GPUs, and cards two by two where a bridge pairs them (a
    # node of two: ``pair``; of more: ``intra``); optional ("" : none named)
    intra: str = ""
    pair: str = ""
    # the answers of matmul_flops_per_s so far: a search asks the same shapes of every layout
    rates: dict = field(default_factory=dict, init=False, compare=False, repr=False)

    def peak(self, precision: str) -> float:
        """The peak FLOP/s of ``precision``; HardwareError where the device has none."""
        if precision not in self.peak_flops:
            hint = "; train.precision = 'fp16' runs on its tensor cores" if "fp16" in self.peak_flops else ""
            raise HardwareError(f"device {self.key} ({self.name}) has no {precision} peak "
                                f"(it has {', '.join(self.peak_flops)}){hint}")
        return self.peak_flops[precision]

    def matmul_flops_per_s(self, m: int, k: int, n: int, dtype: str = "float32", threads: int = 1) -> float:
        """FLOP/s of an (m,k)@(k,n) product: a calibrated device's measured shape nearest in
        log space of (m, k, n), same dtype (half precision computes in float32 here; float64
        unmeasured is float32 halved), at the most BLAS threads measured up to ``threads``;
        a published device's peak of that precision."""
        key = (m, k, n, dtype, threads)
        if key not in self.rates:
            self.rates[key] = self._rate(m, k, n, dtype, threads)
        return self.rates[key]

    def _rate(self, m: int, k: int, n: int, dtype: str, threads: int) -> float:
        precision = PRECISION_OF.get(dtype)
        if precision is None:
            raise HardwareError(f"device {self.key}: dtype {dtype!r}: expected one of {', '.join(PRECISION_OF)}")
        if not self.calibrated:
            if not self.sms:  # a device without a GPU model: its peak
                return self.peak(precision)
            return matmul_flops(m, k, n) / float(gemm_seconds(self, precision, m, k, n))
        want = "float64" if precision == "fp64" else "float32"
        rows = [r for r in self.gemm if r[3] == want] or [r for r in self.gemm if r[3] == "float32"]
        most = max((r[5] for r in rows if r[5] <= threads), default=min(r[5] for r in rows))
        rows = [r for r in rows if r[5] == most]
        here = np.log([m, k, n])
        best = min(rows, key=lambda r: float(np.sum((np.log(r[:3]) - here) ** 2)))
        return best[4] / 2 if best[3] != want else best[4]


@dataclass(frozen=True)
class Link:
    key: str
    name: str
    alpha: float  # seconds per message
    bandwidth: float  # bytes/s per direction per rank
    # {collective: the share of a nonblocking call's time that compute beside it can hide,
    # however long the compute}; absent: 1 (transfers progress on their own, as RDMA's and
    # NCCL's do); calibrated here, where the rank's own core moves the bytes
    overlap: dict = field(default_factory=dict)
    per_node: bool = False  # the bandwidth is a node's, its ranks share it (one port a node); else each rank's
    # the bus bandwidth a collective achieves by the size of its array, as measured (NCCL's nccl-tests
    # busbw): ((bytes, bytes/s), ...) ascending; empty: none published (the line rate and alpha)
    achieved: tuple = ()

    @property
    def measured(self) -> bool:
        """Whether a curve of sizes was measured (its times include the latency)."""
        return len(self.achieved) > 1

    @property
    def p2p(self) -> float:
        """Bytes/s a message between two ranks moves at: the measured figure for the largest
        arrays (a collective's bus bandwidth is its links' rate), else the bandwidth."""
        return self.achieved[-1][1] if self.achieved else self.bandwidth

    def busbw(self, nbytes):
        """Bytes/s a collective on arrays of ``nbytes`` (scalar or array) moves its bytes at:
        the measured curve, between its points linear in the logarithm of the size, beyond the
        largest its last, below the smallest one as slow in time as that one (a latency);
        without a curve, the bandwidth."""
        if len(self.achieved) < 2:  # one figure for every size
            return self.achieved[0][1] if self.achieved else self.bandwidth
        sizes, rates = (np.array(x, dtype=float) for x in zip(*self.achieved))
        n = np.maximum(np.asarray(nbytes, dtype=float), 1.0)
        rate = np.interp(np.log(n), np.log(sizes), rates)
        return np.where(n < sizes[0], rates[0] * n / sizes[0], rate)

    def hides(self, collective: str) -> float:
        return self.overlap.get(collective, 1.0)

    def seconds(self, nbytes: float, messages: int = 1) -> float:
        """Hockney's time of ``messages`` messages carrying ``nbytes`` in all."""
        return self.alpha * messages + nbytes / self.bandwidth


@dataclass(frozen=True)
class Catalogue:
    devices: dict  # key -> Device
    links: dict  # key -> Link
    notes: dict  # the [notes] table as read (TFLOP/s)
    path: str  # the files read, for messages

    def device(self, key: str) -> Device:
        return self._find(self.devices, "device", key)

    def link(self, key: str) -> Link:
        return self._find(self.links, "link", key)

    def _find(self, entries: dict, kind: str, key: str):
        if key not in entries:
            raise HardwareError(f"{self.path}: no {kind} {key!r} (known: {', '.join(entries)})")
        return entries[key]


# ------------------------------------------------------------------ reading
def user_path() -> Path:
    """A user's calibration: $MPITRAIN_HARDWARE, else ~/.config/mpitrain/hardware.toml."""
    return Path(os.environ.get(USER_ENV) or Path.home() / ".config" / "mpitrain" / "hardware.toml")


def this_cpu() -> str:
    """This machine's CPU model and its logical cores, as a calibration names them: the
    machine's, not the cores a process is bound to, so that a rank bound to one core
    under srun or mpiexec names the same machine as the calibration run beside it."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:  # not Linux: no model name
        lines = []
    model = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), "a CPU")
    return f"{model}, {os.cpu_count()} cores"


def this_machine() -> str:
    """This machine as a calibration names it: its CPU and cores; NumPy and its BLAS."""
    from threadpoolctl import threadpool_info

    blas = next((f"{i['internal_api']} {i['version']}" for i in threadpool_info() if i["user_api"] == "blas"), "BLAS")
    return f"{this_cpu()}; NumPy {np.__version__}, {blas}"


def calibrated_elsewhere(device: Device) -> str:
    """For the device "this": a sentence saying that its calibration was measured on
    another machine (another CPU model or core count than :func:`this_cpu`'s), or on this
    one with another NumPy or BLAS than this Python's (:func:`this_machine`), so that
    predictions for "this" are of that machine or software; "" when it was measured on one
    like this with the same software, or for any other device."""
    if device.key != "this":
        return ""
    theirs, _, their_software = (part.strip() for part in device.name.partition(";"))
    ours, _, our_software = (part.strip() for part in this_machine().partition(";"))
    again = "until 'mpitrain plan --calibrate' measures this one"
    if theirs != ours:
        return (f"'this' is a calibration of another machine ({theirs}), not of this one ({ours}): its predictions "
                f"are that machine's {again}")
    if their_software and their_software != our_software:
        return (f"'this' was calibrated with {their_software}, and this Python has {our_software}: its predictions "
                f"are of that software {again}")
    return ""


def load(path=None) -> Catalogue:
    """The shipped catalogue with a user's file overlaid (``path``, else :func:`user_path`
    where it exists; one named but missing is an error): its entries replace the shipped
    ones of the same key. Every field is checked: HardwareError names the file and field."""
    user = Path(path) if path is not None else user_path()
    if (path is not None or os.environ.get(USER_ENV)) and not user.is_file():
        named = "--catalogue" if path is not None else f"${USER_ENV}"
        raise HardwareError(f"{named}: {user}: " + ("a folder, not a hardware file" if user.is_dir() else
                                                    "no such hardware file"))
    files = [SHIPPED] + ([user] if user.is_file() and user.resolve() != SHIPPED.resolve() else [])
    devices, links, notes, read_from = {}, {}, {}, {}
    for f in files:
        tables = read_toml(f)
        for kind, table in tables.items():
            if kind not in ("device", "link", "notes") or not isinstance(table, dict):
                raise HardwareError(f"{f}: {kind}: unknown (expected the tables device.*, link.*, notes)")
            for key, entry in table.items():
                if kind != "notes" and not isinstance(entry, dict):
                    raise HardwareError(f"{f}: {kind}.{key}: expected a table [{kind}.{key}]")
        devices.update({k: parse_device(k, t, f) for k, t in tables.get("device", {}).items()})
        read_from.update(dict.fromkeys(tables.get("device", {}), f))
        links.update({k: _link(k, t, f) for k, t in tables.get("link", {}).items()})
        notes.update({k: _number(tables["notes"], k, f, "notes") for k in tables.get("notes", {})})
        if f == SHIPPED:
            devices["this"] = _of_this_kind(devices)
    for key, device in devices.items():  # a device's links, wherever they are written
        for name in ("intra", "pair"):
            if getattr(device, name) and getattr(device, name) not in links:
                raise HardwareError(f"{read_from.get(key, SHIPPED)}: device.{key}.{name}: no link "
                                    f"{getattr(device, name)!r} (known: {', '.join(links)})")
    return Catalogue(devices, links, notes, " + ".join(map(str, files)))


def _of_this_kind(devices: dict) -> Device:
    """The shipped calibration "this" stands for: the one of this machine's processor
    (:func:`this_cpu`) where one ships (another kind's figures would be that machine's),
    else the shipped "this". A user's "this" replaces it in either case."""
    ours = this_cpu()
    for device in ([devices["this"]] + [d for d in devices.values() if d.calibrated]):
        if device.name.partition(";")[0].strip() == ours:
            return replace(device, key="this")
    return devices["this"]


def read_toml(path: Path) -> dict:
    """A TOML file's tables; HardwareError, naming the file, where it cannot be read or parsed."""
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as e:
        raise HardwareError(f"{path}: cannot read the hardware file ({getattr(e, 'strerror', None) or e})") from None
    except tomllib.TOMLDecodeError as e:
        raise HardwareError(f"{path}: not valid TOML ({e})") from None


def _number(table: dict, field: str, path: Path, where: str, required: bool = True) -> float:
    """A positive finite number (0.0 when absent and not ``required``)."""
    if field not in table and not required:
        return 0.0
    value = table.get(field)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise HardwareError(f"{path}: {where}.{field}: "
                            f"{'missing' if value is None else f'expected a positive number, got {value!r}'}")
    return float(value)


def _curve(points, path: Path, where: str) -> tuple:
    """[[bytes, GB/s], ...] ascending in bytes, or one GB/s for every size -> ((bytes, bytes/s), ...)."""
    if points is None:
        return ()
    if isinstance(points, (int, float)) and not isinstance(points, bool):
        if not 0 < points < math.inf:
            raise HardwareError(f"{path}: {where}: expected a positive number of GB/s, got {points!r}")
        return ((1.0, float(points) * 1e9),)
    ok = isinstance(points, list) and points and all(
        isinstance(p, list) and len(p) == 2 and all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                                    and 0 < v < math.inf for v in p) for p in points)
    if not ok or any(a[0] >= b[0] for a, b in zip(points, points[1:])):
        raise HardwareError(f"{path}: {where}: expected GB/s, or [[bytes, GB/s], ...] ascending in bytes, all "
                            f"positive; got {points!r}")
    return tuple((float(n), float(r) * 1e9) for n, r in points)


def _count(table: dict, field: str, path: Path, where: str) -> int:
    """A positive integer (0 when absent)."""
    value = table.get(field, 0)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0 or (field in table and not value):
        raise HardwareError(f"{path}: {where}.{field}: expected a positive integer, got {value!r}")
    return value


def _fields(table: dict, known: tuple, path: Path, where: str) -> str:
    """The entry's name, after checking that it names no unknown field."""
    for given in table:
        if given not in known:
            raise HardwareError(f"{path}: {where}.{given}: unknown field (expected {', '.join(known)})")
    if not isinstance(table.get("name"), str) or not table["name"]:
        raise HardwareError(f"{path}: {where}.name: {'missing' if 'name' not in table else 'expected a string'}")
    return table["name"]


def parse_device(key: str, table: dict, path) -> Device:
    """The :class:`Device` of a ``[device.KEY]`` table as TOML reads it, every field checked
    (``path`` names the file in the messages)."""
    where = f"device.{key}"
    name = _fields(table, DEVICE_FIELDS, path, where)
    peaks = table.get("peak_flops")
    if not isinstance(peaks, dict) or "fp32" not in peaks:
        what = "expected a table" if not isinstance(peaks, dict) and peaks is not None else "missing"
        raise HardwareError(f"{path}: {where}.peak_flops{'.fp32' if isinstance(peaks, dict) else ''}: {what}")
    for p in peaks:
        if p not in PRECISIONS:
            raise HardwareError(f"{path}: {where}.peak_flops.{p}: unknown precision (known: {', '.join(PRECISIONS)})")
    calibrated = any(f in table for f in CALIBRATED)  # then all of them
    bandwidth = _number(table, "memory_bandwidth_gbs", path, where) * 1e9
    peaks = {p: _number(peaks, p, path, f"{where}.peak_flops") for p in peaks}  # TFLOP/s, each checked
    _within(table, peaks, path, where)
    return Device(key, name, _number(table, "memory_gb", path, where) * 1e9, bandwidth,
                  {p: tflops * 1e12 for p, tflops in peaks.items()},
                  _gemm(table.get("gemm_gflops"), path, f"{where}.gemm_gflops") if calibrated else (),
                  _number(table, "elementwise_bandwidth_gbs", path, where, calibrated) * 1e9 or bandwidth,
                  _number(table, "op_overhead_us", path, where, calibrated) * 1e-6, calibrated,
                  _families(table.get("passes", {}), path, f"{where}.passes"),
                  *({k: v * 1e-6 for k, v in _families(table.get(f, {}), path, f"{where}.{f}").items()}
                    for f in ("layer_overhead_us", "step_overhead_us")),
                  *({k: v * 1e-9 for k, v in _families(table.get(f, {}), path, f"{where}.{f}", MIXED).items()}
                    for f in ("mixed_ns_per_parameter", "cast_ns_per_number")),
                  _number(table, "switch_us", path, where, required=False) * 1e-6,
                  *(_number(table, f, path, where, required=False) * 1e3
                    for f in ("objects_kb", "objects_kb_per_array")),
                  {k: v * 1e12 for k, v in _families(table.get("sustained_flops", {}), path, f"{where}.sustained_flops",
                                                     PRECISIONS).items()},
                  _count(table, "sms", path, where),
                  _number(table, "memory_bound_gbs", path, where, required=False) * 1e9 or bandwidth,
                  {k: v * 1e12 for k, v in _families(table.get("achievable_flops", {}), path,
                                                     f"{where}.achievable_flops", PRECISIONS).items()},
                  *(_key(table, f, path, where) for f in ("intra", "pair")))


def _within(table: dict, peaks: dict, path: Path, where: str) -> None:
    """A rate no device reaches beyond its own ceiling: products (measured or sustained) at most the peak of
    their precision, a kernel's bandwidth at most the memory's."""
    number = lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)  # noqa: E731 (else: checked later)
    for name in ("achievable_flops", "sustained_flops"):
        rates = table.get(name)
        for precision, rate in (rates.items() if isinstance(rates, dict) else ()):
            peak = peaks.get(precision)
            if number(rate) and (peak is None or rate > peak):
                raise HardwareError(f"{path}: {where}.{name}.{precision}: {rate!r} TFLOP/s " + (
                    f"is above the peak, peak_flops.{precision} = {peak!r}" if peak is not None else
                    f"for a precision without a peak (peak_flops has {', '.join(peaks)})"))
    stream, memory = table.get("memory_bound_gbs"), table.get("memory_bandwidth_gbs")
    if number(stream) and number(memory) and stream > memory:
        raise HardwareError(f"{path}: {where}.memory_bound_gbs: {stream!r} GB/s is above the memory's bandwidth, "
                            f"memory_bandwidth_gbs = {memory!r}")


def _key(table: dict, field: str, path: Path, where: str) -> str:
    """A catalogue key (a non-empty string; "" when absent): :func:`load` checks that it names an entry."""
    value = table.get(field, "")
    if not isinstance(value, str) or (field in table and not value.strip()):
        raise HardwareError(f"{path}: {where}.{field}: expected a link's key such as \"nvlink3\", got {value!r}")
    return value.strip()


def _gemm(rows, path: Path, where: str) -> tuple:
    """[[m, k, n, dtype, GFLOP/s(, BLAS threads)], ...] -> ((m, k, n, dtype, FLOP/s, threads), ...),
    a float32 row among them; a row without threads was measured at one."""
    if not isinstance(rows, list) or not any(isinstance(r, list) and r[3:4] == ["float32"] for r in rows):
        raise HardwareError(f"{path}: {where}: {'missing' if rows is None else 'expected rows, one float32 at least'}")
    for i, row in enumerate(rows):
        if not (isinstance(row, list) and len(row) in (5, 6) and row[3] in GEMM_DTYPES and all(
                isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in row[:3] + row[5:])):
            raise HardwareError(f"{path}: {where}[{i}]: expected [m, k, n, dtype, GFLOP/s] or [..., BLAS threads], "
                                f"m k n threads positive integers, dtype one of {', '.join(GEMM_DTYPES)}; got {row!r}")
    return tuple((*r[:4], _number({"GFLOP/s": r[4]}, "GFLOP/s", path, f"{where}[{i}]") * 1e9, (r[5:] or [1])[0])
                 for i, r in enumerate(rows))


def _families(table, path: Path, where: str, known: tuple = FAMILIES) -> dict:
    """{key: number}: each a ``known`` key's positive number (a model family's by default)."""
    what = "family" if known is FAMILIES else "key"
    if not isinstance(table, dict):
        raise HardwareError(f"{path}: {where}: expected a table [{where}] of {what} = number")
    for family in table:
        if family not in known:
            raise HardwareError(f"{path}: {where}.{family}: unknown {what} (known: {', '.join(known)})")
    return {family: _number(table, family, path, where) for family in table}


def _link(key: str, table: dict, path: Path) -> Link:
    where = f"link.{key}"
    overlap = table.get("overlap", {})
    if not isinstance(overlap, dict):
        raise HardwareError(f"{path}: {where}.overlap: expected a table [{where}.overlap] of collective = share")
    for kind, share in overlap.items():
        if kind not in OVERLAPPED:
            raise HardwareError(f"{path}: {where}.overlap.{kind}: unknown collective (known: {', '.join(OVERLAPPED)})")
        if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 <= share <= 1:
            raise HardwareError(f"{path}: {where}.overlap.{kind}: expected a number from 0 to 1, got {share!r}")
    per_node = table.get("per_node", False)
    if not isinstance(per_node, bool):
        raise HardwareError(f"{path}: {where}.per_node: expected true or false, got {per_node!r}")
    return Link(key, _fields(table, LINK_FIELDS, path, where), _number(table, "alpha_us", path, where) * 1e-6,
                _number(table, "bandwidth_gbs", path, where) * 1e9, {k: float(v) for k, v in overlap.items()},
                per_node, _curve(table.get("achieved_gbs"), path, f"{where}.achieved_gbs"))
