"""The planner's hardware catalogue (mpitrain/plan/hardware.py, hardware.toml) and its
calibration (mpitrain/plan/calibrate.py): the shipped file loads and holds what the planner
needs, a user's file overlays it, every bad field is one message naming file and field,
mpitrain's elementwise passes are measured as defined, and a calibration writes a file that
loads back."""

import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from mpitrain.cluster import mpiexec
from mpitrain.config import load as load_config
from mpitrain.output import write_text
from mpitrain.plan import calibrate, hardware, objects, shapes, steps, timing
from mpitrain.plan.hardware import HardwareError
from mpitrain.runtime import available_cores

PUBLISHED = ("v100", "a100-40g", "a100-80g", "h100", "h200")
TINY = (steps.gpt_probe(V=16, T=8, L=1, H=2, C=16, batch=4),  # a step in milliseconds
        steps.cnn_probe("lenet", (8, 8, 1), batch=4, channels=(2, 4), hidden=8))


@pytest.fixture
def shipped(monkeypatch, tmp_path):
    """The shipped catalogue alone: no user file, whatever this machine's home holds."""
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv(hardware.USER_ENV, raising=False)
    return hardware.load()


def write(tmp_path, text):
    path = tmp_path / "user.toml"
    path.write_text(text)
    return path


def test_the_shipped_catalogue_loads_with_what_the_planner_needs(shipped):
    assert set(PUBLISHED) | {"this"} <= set(shipped.devices)
    for key, device in shipped.devices.items():
        assert device.memory_bytes > 0 and device.memory_bandwidth > 0 and device.elementwise_bandwidth > 0, key
        assert {"fp32", "fp16"} <= set(device.peak_flops), key
        assert "bf16" in device.peak_flops or key == "v100", key  # Volta has no bf16 units
    assert set(shipped.links) >= {"shm", "nvlink3", "nvlink4", "ib-hdr", "ib-ndr", "eth-10g", "eth-25g", "eth-100g",
                                  "emu-1g", "emu-10g"}
    assert all(link.alpha > 0 and link.bandwidth > 0 for link in shipped.links.values())
    assert shipped.notes == {"V100": 130, "A100": 312, "H100": 3958}


def test_published_figures_are_the_datasheets_dense_ones(shipped):
    h100, a100 = shipped.device("h100"), shipped.device("a100-80g")
    assert h100.memory_bytes == 80e9 and h100.memory_bandwidth == 3350e9
    assert h100.peak_flops["bf16"] == 989.5e12 and h100.peak_flops["fp8"] == 1979e12  # half the sparse 1,979, 3,958
    assert a100.peak_flops["bf16"] == 312e12 and "fp8" not in a100.peak_flops
    assert shipped.link("nvlink3").bandwidth == 300e9 and shipped.link("nvlink4").bandwidth == 450e9
    assert shipped.link("ib-hdr").bandwidth == 25e9 and shipped.link("ib-ndr").bandwidth == 50e9
    assert shipped.device("this").calibrated and not h100.calibrated
    assert h100.passes == {} and set(shipped.device("this").passes) == set(hardware.FAMILIES)
    assert all(p > 0 for p in shipped.device("this").passes.values())


def test_a_user_file_replaces_the_entries_of_its_keys(shipped, tmp_path):
    path = write(tmp_path, '[device.h100]\nname = "my H100"\nmemory_gb = 94\nmemory_bandwidth_gbs = 3900\n'
                           '[device.h100.peak_flops]\nfp32 = 60\n[link.mine]\nname = "x"\nalpha_us = 2\n'
                           'bandwidth_gbs = 10\n')
    catalogue = hardware.load(path=path)
    assert catalogue.device("h100").name == "my H100" and catalogue.device("h100").peak_flops == {"fp32": 60e12}
    assert catalogue.device("a100-80g") == shipped.device("a100-80g")
    assert catalogue.link("mine").seconds(0) == 2e-6 and str(path) in catalogue.path


def test_the_environment_names_the_user_file(monkeypatch, tmp_path):
    path = write(tmp_path, '[link.shm]\nname = "mine"\nalpha_us = 1\nbandwidth_gbs = 1\n')
    monkeypatch.setenv(hardware.USER_ENV, str(path))
    assert hardware.load().link("shm").name == "mine"
    monkeypatch.setenv(hardware.USER_ENV, str(tmp_path / "absent.toml"))
    with pytest.raises(HardwareError, match=r"^\$MPITRAIN_HARDWARE: .*absent.toml: no such hardware file$"):
        hardware.load()
    with pytest.raises(HardwareError, match=r"^--catalogue: .*: a folder, not a hardware file$"):
        hardware.load(path=tmp_path)


DEVICE = '[device.d]\nname = "d"\nmemory_gb = 1\nmemory_bandwidth_gbs = 1\n[device.d.peak_flops]\nfp32 = 1\n'


@pytest.mark.parametrize("text, message", [
    (DEVICE + "fp4 = 1\n", "device.d.peak_flops.fp4: unknown precision"),
    (DEVICE.replace("memory_gb = 1", "memory_gb = -80"), "device.d.memory_gb: expected a positive number, got -80"),
    (DEVICE.replace("memory_gb = 1", "memory_gb = true"), "device.d.memory_gb: expected a positive number"),
    (DEVICE.replace("memory_bandwidth_gbs = 1\n", ""), "device.d.memory_bandwidth_gbs: missing"),
    (DEVICE.replace('name = "d"\n', ""), "device.d.name: missing"),
    (DEVICE.replace("fp32", "bf16"), "device.d.peak_flops.fp32: missing"),
    (DEVICE.replace("memory_gb", "memory_gib"), "device.d.memory_gib: unknown field"),
    (DEVICE + "[device.d.x]\n", "device.d.x: unknown field"),
    (DEVICE + "[device.d.passes]\nrnn = 3\n",
     "device.d.passes.rnn: unknown family (known: gpt, gpt-sliced, gpt-sequence, gpt-plain, gpt-split, cnn)"),
    (DEVICE + "[device.d.passes]\ngpt = -1\n", "device.d.passes.gpt: expected a positive number, got -1"),
    (DEVICE + "[device.d.passes]\ncnn = 'many'\n", "device.d.passes.cnn: expected a positive number"),
    (DEVICE.replace("memory_gb = 1", "memory_gb = 1\npasses = 3"), "device.d.passes: expected a table"),
    (DEVICE.replace("memory_gb = 1", "memory_gb = 1\nop_overhead_us = 1\nelementwise_bandwidth_gbs = 1"),
     "device.d.gemm_gflops: missing"),
    (DEVICE.replace("memory_gb = 1", 'memory_gb = 1\nop_overhead_us = 1\nelementwise_bandwidth_gbs = 1\n'
                    'gemm_gflops = [[64, 64, 64, "float32", 9], [64, 64, 64, "int8", 9]]'), "gemm_gflops[1]: expected"),
    ('[link.l]\nname = "l"\nalpha_us = 1\n', "link.l.bandwidth_gbs: missing"),
    ('[link.l]\nname = "l"\nalpha_us = 0\nbandwidth_gbs = 1\n', "link.l.alpha_us: expected a positive number, got 0"),
    ('[link.l]\nname = "l"\nalpha_us = 1\nbandwidth_gbs = 1\n[link.l.overlap]\nallgather = 1.5\n',
     "link.l.overlap.allgather: expected a number from 0 to 1, got 1.5"),
    ('[link.l]\nname = "l"\nalpha_us = 1\nbandwidth_gbs = 1\n[link.l.overlap]\nbcast = 1\n',
     "link.l.overlap.bcast: unknown collective (known: allreduce, allgather, reduce_scatter)"),
    ('[link.l]\nname = "l"\nalpha_us = 1\nbandwidth_gbs = 1\noverlap = 0.5\n', "link.l.overlap: expected a table"),
    ('[link.l]\nname = "l"\nalpha_us = 1\nbandwidth_gbs = 1\nachieved_gbs = 0\n',
     "link.l.achieved_gbs: expected a positive number of GB/s, got 0"),
    (DEVICE.replace("memory_gb = 1", 'memory_gb = 1\nintra = "nvlink9"'),
     "device.d.intra: no link 'nvlink9' (known: nvlink2, "),
    (DEVICE.replace("memory_gb = 1", 'memory_gb = 1\npair = 3'),
     'device.d.pair: expected a link\'s key such as "nvlink3"'),
    (DEVICE + "bf16 = 4\n[device.d.achievable_flops]\nbf16 = 5\n",
     "device.d.achievable_flops.bf16: 5 TFLOP/s is above the peak, peak_flops.bf16 = 4"),
    (DEVICE + "[device.d.sustained_flops]\nfp16 = 1\n",
     "device.d.sustained_flops.fp16: 1 TFLOP/s for a precision without a peak (peak_flops has fp32)"),
    (DEVICE.replace("memory_gb = 1", "memory_gb = 1\nmemory_bound_gbs = 2"),
     "device.d.memory_bound_gbs: 2 GB/s is above the memory's bandwidth, memory_bandwidth_gbs = 1"),
    ("[notes]\nV100 = -1\n", "notes.V100: expected a positive number"),
    ("[gpus]\n", "gpus: unknown"),
    ("[device]\nv100 = 3\n", "device.v100: expected a table"),
    ("[device.d\nname = 1", "not valid TOML"),
])
def test_a_bad_file_is_one_line_naming_file_and_field(shipped, tmp_path, text, message):
    path = write(tmp_path, text)
    with pytest.raises(HardwareError) as e:
        hardware.load(path=path)
    assert str(e.value).startswith(f"{path}: ") and message in str(e.value) and "\n" not in str(e.value)


def test_passes_load_per_family_and_are_optional(tmp_path):
    catalogue = hardware.load(path=write(tmp_path, DEVICE + "[device.d.passes]\ngpt = 17.5\ncnn = 8\n"))
    assert catalogue.device("d").passes == {"gpt": 17.5, "cnn": 8.0}
    assert hardware.load(path=write(tmp_path, DEVICE)).device("d").passes == {}


def test_an_unknown_key_lists_the_known_ones(shipped):
    with pytest.raises(HardwareError, match=r"no device 'b200' \(known: v100, a100-40g"):
        shipped.device("b200")
    with pytest.raises(HardwareError, match="no link 'ib-xdr'"):
        shipped.link("ib-xdr")


def test_published_devices_give_the_gpu_models_rate_of_the_precision(shipped):
    """A published GPU's product rate is the GPU model's (mpitrain/plan/gpu.py): tiles of
    256 x 128 (or 128 x 128) in waves over its SMs at the rate measured for the fastest
    shape; one full wave reaches that rate, one tile column more costs a wave of the
    smaller tiles; a tiny product is a kernel launch; a device without a GPU model (no SMs)
    gives its peak; a precision the device lacks is refused, naming it."""
    from dataclasses import replace

    from mpitrain.plan import gpu

    a100 = shipped.device("a100-80g")
    assert a100.sms == 108 and a100.achievable["bf16"] == 271.2e12
    assert a100.matmul_flops_per_s(3072, 8192, 1152, "bfloat16") == pytest.approx(271.2e12)  # 12 x 9 tiles: a wave
    # 12 x 10 tiles of 256 x 128 are 2 waves; 24 x 10 of 128 x 128 are 3 waves of half the work: 1.5 waves
    assert a100.matmul_flops_per_s(3072, 8192, 1280, "bf16") == pytest.approx(271.2e12 * 1280 / (1.5 * 1152))
    assert a100.matmul_flops_per_s(8, 8, 8, "bf16") == pytest.approx(2 * 8**3 / gpu.LAUNCH_S)
    h100 = shipped.device("h100")
    thin = 2 * (2 * 8192 * 16 + 8192 * 8192) / h100.stream_bandwidth  # K = 16: the matrices' bytes bound it
    assert h100.matmul_flops_per_s(8192, 16, 8192, "bf16") == pytest.approx(2 * 8192 * 16 * 8192 / thin)
    assert h100.matmul_flops_per_s(4096, 4096, 4096, "float32") < 67e12  # float32 -> fp32: its peak, no faster
    assert gpu.sustained(h100, "fp8") == 1979e12 and gpu.sustained(h100, "fp32") == 67e12  # none measured
    plain = replace(h100, sms=0)  # (its answers so far are not carried over)
    assert plain.matmul_flops_per_s(8, 8, 8) == 67e12 and plain.matmul_flops_per_s(1, 1, 1, "bf16") == 989.5e12
    with pytest.raises(HardwareError, match="v100 .* has no bf16 peak"):
        shipped.device("v100").matmul_flops_per_s(64, 64, 64, "bfloat16")
    with pytest.raises(HardwareError, match="dtype 'int8'"):
        h100.matmul_flops_per_s(64, 64, 64, "int8")


def test_a_links_bus_bandwidth_follows_its_measured_curve(shipped):
    """NVLink 3's busbw by array size as nccl-tests measured it: each point exact, linear in
    the logarithm of the size between two, the last beyond; below the first, as slow in
    time as it (a latency); a link with one figure gives it at every size, one without any
    its line rate; the catalogue refuses a curve that does not ascend, naming the field."""
    nvlink, ib, eth = (shipped.link(k) for k in ("nvlink3", "ib-hdr", "eth-10g"))
    assert nvlink.busbw(2**27) == pytest.approx(176.92e9) and nvlink.busbw(2**40) == pytest.approx(234.89e9)
    assert nvlink.busbw(2**25 * 2**0.5) == pytest.approx((138.49e9 + 171.54e9) / 2)
    assert 2**20 / nvlink.busbw(2**20) == pytest.approx(2**23 / 109.93e9)
    assert ib.busbw(1.0) == ib.busbw(1e12) == 24e9 and eth.busbw(5e6) == eth.bandwidth
    assert nvlink.measured and not ib.measured


def test_a_gpu_models_fields_are_checked(tmp_path):
    bad = tmp_path / "hw.toml"
    for text, match in (("[link.x]\nname = 'x'\nalpha_us = 1\nbandwidth_gbs = 1\nachieved_gbs = [[2, 1], [1, 1]]\n",
                         r"link.x.achieved_gbs: expected GB/s, or \[\[bytes, GB/s\], ...\] ascending"),
                        ("[device.x]\nname = 'x'\nmemory_gb = 1\nmemory_bandwidth_gbs = 1\nsms = 1.5\n"
                         "[device.x.peak_flops]\nfp32 = 1\n", r"device.x.sms: expected a positive integer")):
        bad.write_text(text)
        with pytest.raises(HardwareError, match=match):
            hardware.load(bad)


def test_calibrated_devices_take_the_nearest_measured_shape():
    gemm = ((64, 64, 64, "float32", 1e9, 1), (1024, 1024, 1024, "float32", 4e9, 1), (768, 128, 384, "float32", 3e9, 1),
            (1024, 1024, 1024, "float64", 2.5e9, 1))
    device = hardware.Device("c", "c", 1e9, 1e9, {"fp32": 4e9}, gemm, 1e9, 1e-6, calibrated=True)
    assert device.matmul_flops_per_s(70, 60, 64) == 1e9
    assert device.matmul_flops_per_s(2048, 2048, 2048) == 4e9
    assert device.matmul_flops_per_s(800, 120, 400) == 3e9  # nearer in log space than the cube of 1024
    assert device.matmul_flops_per_s(64, 64, 64, "float64") == 2.5e9  # the only float64 shape
    assert device.matmul_flops_per_s(64, 64, 64, "bfloat16") == 1e9  # half precision computes in float32 here
    no64 = hardware.Device("c", "c", 1e9, 1e9, {"fp32": 4e9}, gemm[:3], 1e9, 1e-6, calibrated=True)
    assert no64.matmul_flops_per_s(1000, 1000, 1000, "float64") == 2e9  # float32's, halved


def test_calibrated_gemm_rates_are_those_of_the_threads_a_rank_has():
    gemm = ((1024, 1024, 1024, "float32", 4e9, 1), (1024, 1024, 1024, "float32", 7e9, 2),
            (64, 64, 64, "float32", 1e9, 1))
    device = hardware.Device("c", "c", 1e9, 1e9, {"fp32": 4e9}, gemm, 1e9, 1e-6, calibrated=True)
    assert device.matmul_flops_per_s(1024, 1024, 1024) == 4e9
    assert device.matmul_flops_per_s(1024, 1024, 1024, threads=2) == 7e9
    assert device.matmul_flops_per_s(1024, 1024, 1024, threads=8) == 7e9  # the most measured up to 8
    assert device.matmul_flops_per_s(64, 64, 64, threads=2) == 7e9  # the shapes of 2 threads' rows only
    machine = timing.Machine(device, None, None, per_node=2, cores=4)
    assert machine.threads() == 2 and machine.threads(3) == 3  # cores over ranks, unless train.threads says
    assert timing.Machine(device, None, None, per_node=8, cores=4).threads() == 1


def test_gemm_rows_may_name_their_threads(tmp_path):
    calibrated = DEVICE.replace("memory_gb = 1", "memory_gb = 1\nop_overhead_us = 1\nelementwise_bandwidth_gbs = 1\n"
                                "gemm_gflops = [[64, 64, 64, 'float32', 50.0], [64, 64, 64, 'float32', 90.0, THREADS]]")
    gemm = hardware.load(path=write(tmp_path, calibrated.replace("THREADS", "2"))).device("d").gemm
    assert [row[5] for row in gemm] == [1, 2]
    with pytest.raises(HardwareError, match=r"gemm_gflops\[1\]: expected"):
        hardware.load(path=write(tmp_path, calibrated.replace("THREADS", "0")))


def test_link_seconds_is_alpha_plus_bytes_over_bandwidth():
    link = hardware.Link("l", "l", alpha=5e-6, bandwidth=1.25e9)
    assert link.seconds(0) == 5e-6
    assert link.seconds(1.25e9) == pytest.approx(1 + 5e-6)
    assert link.seconds(2.5e6, messages=4) == pytest.approx(4 * 5e-6 + 2e-3)


def test_compute_hides_at_most_each_collectives_share_of_a_call():
    from mpitrain.plan.timing import hidden

    rdma = hardware.Link("l", "l", 1e-6, 1e9)  # no shares given: every call can be hidden
    tcp = hardware.Link("t", "t", 1e-6, 1e9, {"allgather": 0.75, "reduce_scatter": 0.5})
    assert rdma.hides("allgather") == 1 and hidden(3.0, rdma, {"allgather": 2.0}) == 2.0
    assert hidden(1.0, rdma, {"allgather": 2.0}) == 1.0 and hidden(-1.0, rdma, {"allgather": 2.0}) == 0.0
    assert hidden(10.0, tcp, {"allgather": 2.0, "reduce_scatter": 2.0}) == pytest.approx(2.5)
    assert hidden(10.0, tcp, {"allreduce": 2.0}) == 2.0  # a collective not measured: all of it


def test_the_link_fit_recovers_alpha_and_bandwidth():
    sizes = [8 << i for i in range(22)]
    rows = [(n, 3e-6 + n / 10e9) for n in sizes]
    alpha, bandwidth = calibrate.fit_link(rows)
    assert alpha == pytest.approx(3e-6) and bandwidth == pytest.approx(10e9)
    bucket = [(n, t if n >= 1 << 20 else 3e-6 + n / 100e9) for n, t in rows]  # small messages pass faster
    assert calibrate.fit_link(bucket) == pytest.approx((3e-6, 10e9), rel=1e-3)
    with pytest.raises(HardwareError, match="too busy"):
        calibrate.fit_link([(n, 1e-3 - n * 1e-12) for n in sizes])


def test_toml_written_reads_back_exactly(tmp_path):
    tables = {"device": {"x-1": {"name": 'a "quoted" \\ name', "memory_gb": 0.1 + 0.2, "gemm_gflops": [
        [1, 2, 3, "float32", 1e-7]], "peak_flops": {"fp32": 1e300}}}, "link": {}}
    path = tmp_path / "sub" / "out.toml"
    write_text(path, calibrate.to_toml(tables, "a header\nof two lines"))
    assert hardware.read_toml(path) == tables and path.read_text().startswith("# a header\n# of two lines\n")
    assert [p.name for p in path.parent.iterdir()] == ["out.toml"]  # the temporary file was renamed


def test_calibrate_writes_a_file_that_loads_back(shipped, tmp_path):
    out = tmp_path / "hw.toml"
    out.write_text('[link.kept]\nname = "from before"\nalpha_us = 1\nbandwidth_gbs = 1\n')
    links = ("shm",) if shutil.which(mpiexec()) else ()
    for attempt in range(3):  # one repeat of tiny shapes: a busy machine can spoil a fit, as calibrate says
        lines = []
        try:
            measured = calibrate.calibrate(shapes=[(32, 32, 32), (64, 16, 8, "float64")], links=links, out=out,
                                           log=lines.append, repeats=1, max_bytes=1 << 16, probes=TINY,
                                           busy_ok=True)  # the unit tier's other worker shares the cores
            break
        except HardwareError as e:
            if "too busy to measure" not in str(e) or attempt == 2:
                raise
    catalogue = hardware.load(path=out)
    this = catalogue.device("this")
    ones = [r[:4] for r in this.gemm if r[5] == 1]
    assert this.calibrated and ones == [(32, 32, 32, "float32"), (64, 16, 8, "float64")]
    assert {r[5] for r in this.gemm} == {1, available_cores()}  # one thread, and all of them
    assert this.peak_flops["bf16"] == this.peak_flops["fp32"] == pytest.approx(this.gemm[0][4])
    assert this.op_overhead_s > 0 and this.passes == measured["device"]["this"]["passes"]
    assert set(this.passes) == {"gpt", "cnn"} and all(p > 0 for p in this.passes.values())
    assert this.matmul_flops_per_s(32, 32, 32) == measured["device"]["this"]["gemm_gflops"][0][4] * 1e9
    assert catalogue.link("kept").name == "from before"  # what was not measured again stays
    if links:
        assert set(measured["link"]) == {"shm"} and catalogue.link("shm").bandwidth > 0
        shares = measured["link"]["shm"]["overlap"]
        assert catalogue.link("shm").overlap == shares and set(shares) == set(hardware.OVERLAPPED)
        assert all(0 <= v <= 1 for v in shares.values())
    assert any(line.startswith("gemm (32, 32)") for line in lines) and np.isfinite(this.elementwise_bandwidth)
    assert this.switch == measured["device"]["this"].get("switch_us", 0) * 1e-6 >= 0  # 0: not measured here
    assert any(line.startswith("a blocking call between 2 ranks on one core: ") for line in lines)
    found = measured["device"]["this"]
    assert this.objects == found["objects_kb"] * 1e3 > 0
    assert this.objects_per_array == found["objects_kb_per_array"] * 1e3 > 0
    assert sum(line.startswith("objects: ") for line in lines) == len(objects.MODELS)  # each in a process of its own
    assert this.name == hardware.this_machine() and hardware.calibrated_elsewhere(this) == ""


@pytest.mark.skipif(not Path("/proc/stat").exists(), reason="counts the cores' time in Linux's /proc/stat")
def test_a_calibration_refuses_a_busy_machine_and_writes_nothing(tmp_path):
    """Two CPU-bound processes beside it on this process's cores: calibration refuses
    before measuring anything, naming the load and the way to write it anyway, and leaves
    no file; with busy_ok it warns."""
    from mpitrain.runtime import my_cores

    spin = [sys.executable, "-c", "while True: pass"]
    hogs = [subprocess.Popen(spin) for _ in range(2)]
    try:
        time.sleep(0.2)
        assert calibrate.others_busy() > min(2, len(my_cores())) * 0.8 > calibrate.BUSY_CORES
        with pytest.raises(HardwareError, match=r"the machine is busy before calibrating: other processes used "
                                                r"[0-9.]+ of the \d+ core\(s\) .*nothing was written.*--busy-ok"):
            calibrate.calibrate(out=tmp_path / "hw.toml", log=lambda line: None)
        said = []
        calibrate.check_quiet("now", busy_ok=True, log=said.append)
        assert len(said) == 1 and said[0].startswith("warning: the machine is busy now") and "--busy-ok" in said[0]
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
    assert not (tmp_path / "hw.toml").exists() and list(tmp_path.iterdir()) == []


def test_a_calibration_with_other_software_is_said(shipped, monkeypatch):
    """The same CPU, another NumPy or BLAS than the calibration's: its predictions are of
    that software, said once with the command that measures again."""
    this = shipped.device("this")
    theirs = this.name.split(";")[0].strip()
    monkeypatch.setattr(hardware, "this_cpu", lambda: theirs)
    monkeypatch.setattr(hardware, "this_machine", lambda: f"{theirs}; NumPy 9.9.9, openblas 1.0")
    note = hardware.calibrated_elsewhere(this)
    assert note == (f"'this' was calibrated with {this.name.split(';')[1].strip()}, and this Python has NumPy 9.9.9, "
                    "openblas 1.0: its predictions are of that software until 'mpitrain plan --calibrate' measures "
                    "this one")
    monkeypatch.setattr(hardware, "this_machine", lambda: this.name)
    assert hardware.calibrated_elsewhere(this) == ""


def test_a_calibration_of_another_machine_is_said_where_its_predictions_are_printed(shipped, monkeypatch):
    """'this' from the shipped catalogue on a user's machine predicts the developers'
    machine: mpitrain plan's header and a run's closing plan lines say so, naming both
    machines and the command that measures this one; where the CPU model and cores are
    the calibration's, nothing is added."""
    from mpitrain import plan as planner
    from mpitrain.config import load
    from mpitrain.observe import prediction
    from mpitrain.plan import show

    monkeypatch.setattr(hardware, "_of_this_kind", lambda devices: devices["this"])  # the shipped "this" alone
    shipped = hardware.load()
    this = shipped.device("this")
    cfg = load("jobs/shakespeare_gpt.toml", data_needed=False)
    plan = planner.make(cfg, 2, planner.machine(shipped, "this", 2))
    states = [({"param_bytes": 1, "grad_bytes": 1, "optim_bytes": 1, "work_bytes": 1}, None)] * 2
    theirs = this.name.split(";")[0]  # the CPU model and cores; NumPy and BLAS follow
    model = theirs.rsplit(",", 1)[0]
    for cpu in (theirs, f"{model}, 96 cores", "AMD EPYC 9654 96-Core Processor, 2 cores"):
        monkeypatch.setattr(hardware, "this_cpu", lambda: cpu)
        software = this.name.split(";")[1].strip()  # the calibration's NumPy and BLAS
        monkeypatch.setattr(hardware, "this_machine", lambda: f"{cpu}; {software}")
        note = hardware.calibrated_elsewhere(this)
        header, closing = show.header(plan, "x"), prediction.end_of_run(cfg, 2, 0.1, states)
        if cpu == theirs:
            assert note == "" and not any("calibration of another machine" in line for line in header + closing)
            continue
        assert f"another machine ({theirs}), not of this one ({cpu})" in note and "mpitrain plan --calibrate" in note
        assert header[-1] == f"note: {note}" and closing[-1] == f"plan: {note}"
        assert hardware.calibrated_elsewhere(shipped.device("h100")) == ""  # a datasheet's device is no machine


def test_this_is_the_shipped_calibration_of_this_machines_processor(shipped, monkeypatch, tmp_path):
    """Each kind of machine the project's calibrations ship for gets its own as "this" (and
    no note that it is another machine's); any other gets the shipped "this"; a user's
    calibration replaces it on any machine."""
    kinds = {k: d for k, d in shipped.devices.items() if d.calibrated and k != "this"}
    kinds["plain"] = hardware.parse_device("this", hardware.read_toml(hardware.SHIPPED)["device"]["this"],
                                           hardware.SHIPPED)  # the shipped "this" itself
    assert len(kinds) >= 2 and len({d.name for d in kinds.values()}) == len(kinds)
    for key, device in kinds.items():
        cpu = device.name.partition(";")[0].strip()
        monkeypatch.setattr(hardware, "this_cpu", lambda: cpu)
        this = hardware.load().device("this")
        assert (this.key, this.name, this.gemm) == ("this", device.name, device.gemm), key
    monkeypatch.setattr(hardware, "this_cpu", lambda: "Another CPU, 64 cores")
    assert hardware.load().device("this").name == kinds["plain"].name
    user = tmp_path / "mine.toml"
    user.write_text(DEVICE.replace("device.d", "device.this"))
    monkeypatch.setattr(hardware, "this_cpu", lambda: kinds["plain"].name.partition(";")[0].strip())
    assert hardware.load(user).device("this").name != kinds["plain"].name


def test_traffic_counts_kept_numbers_and_each_convolutions_columns():
    lenet = shapes.lenet((28, 28, 1), 10)
    conv1, conv2 = lenet.layers[0], lenet.layers[2]
    assert conv1.traffic == conv1.kept + 28 * 28 * 5 * 5 * 1
    assert conv2.traffic == conv2.kept + 14 * 14 * 5 * 5 * 16
    block = shapes.resnet((32, 32, 3), 10, (16, 32, 64), 1).layers[2]  # 16 -> 32 channels, stride 2, a shortcut
    assert block.traffic == block.kept + 16 * 16 * (9 * 16 + 9 * 32 + 16)
    gpt = shapes.gpt(84, 64, 2, 4, 128)
    assert [layer.traffic for layer in gpt.layers] == [layer.kept for layer in gpt.layers]


def test_gemm_seconds_are_each_layers_flops_at_its_shapes_rate():
    gemm = ((64, 64, 64, "float32", 1e9, 1),)
    device = hardware.Device("c", "c", 1e9, 1e9, {"fp32": 1e9}, gemm, 2e9, 1e-6, calibrated=True)
    model = shapes.convnet((32, 32, 3), 10)
    flops = sum(layer.forward + layer.backward for layer in model.layers) * 4
    assert steps.gemm_seconds(device, model, 4) == pytest.approx(flops / 1e9)


def test_steps_split_into_passes_a_time_per_micro_batch_and_one_per_step():
    device = hardware.Device("c", "c", 1e9, 1e9, {"fp32": 1e9}, ((64, 64, 64, "float32", 1e9, 1),), 2e9, 1e-6,
                             calibrated=True)
    timed = []
    for model in (shapes.convnet((32, 32, 3), 10), shapes.lenet((28, 28, 1), 10)):
        layers = len(model.layers)
        for b, m in ((8, 1), (4, 1), (2, 1), (2, 4)):  # 3 passes, 50 us a layer and micro-batch, 20 a step
            seconds = m * (steps.gemm_seconds(device, model, b) + 3 * 4 * b * sum(x.traffic for x in model.layers)
                           / 2e9 + 50e-6 * layers)
            timed.append((model, b, m, seconds + 20e-6 * layers))
    assert steps.split_steps(device, timed) == pytest.approx((3, 50e-6, 20e-6))
    noisy = [(model, b, m, t - 40e-6 * len(model.layers)) for model, b, m, t in timed]  # a step looks faster than free
    passes, per_micro, per_step = steps.split_steps(device, noisy)
    assert passes > 0 and per_micro > 0 and per_step == 0.0  # the part that came out negative is left out


def test_measure_mixed_is_the_cost_beyond_float32_per_parameter():
    lines = []
    per_parameter, per_number = steps.measure_mixed(TINY[0], ("bf16",), repeats=1, log=lines.append)
    assert set(per_parameter) <= {"bf16"} and all(ns > 0 for ns in per_parameter.values())
    assert set(per_number) == {"bf16"} and per_number["bf16"] > 0
    assert len(lines) == 1 and lines[0].startswith("mixed gpt 1L/2H/16C T8 B4 bf16: ")


@pytest.mark.parametrize("sets, family", [([], "gpt"), (["parallel.tp=2"], "gpt-sliced"),
                                          (["parallel.tp=2", "parallel.sequence_parallel=true"], "gpt-sequence"),
                                          (["parallel.pp=2", "parallel.schedule='zb-h1'", "train.micro_batches=4"],
                                           "gpt-split"),
                                          (["parallel.pp=2", "train.micro_batches=4"], "gpt"),
                                          (["train.fast_paths=false"], "gpt-plain")])
def test_a_rank_is_timed_by_the_path_its_blocks_run(sets, family):
    from mpitrain import config
    from mpitrain.plan.data import resolve
    from mpitrain.plan.layout import Layout
    from mpitrain.plan.predict import rank_plans

    cfg = config.load("jobs/shakespeare_gpt.toml", sets, data_needed=False)
    lay = Layout.of(cfg, 2, resolve(cfg))
    assert {timing.path(lay, p) for p in rank_plans(lay)} == {family}


def test_measure_steps_times_tiny_models_per_family(shipped):
    lines = []
    passes, per_micro, per_step = steps.measure_steps(shipped.device("this"), TINY, repeats=1, log=lines.append)
    assert set(passes) == {"gpt", "cnn"} and all(np.isfinite(p) and p > 0 for p in passes.values())
    for overhead in (per_micro, per_step):
        assert set(overhead) <= {"gpt", "cnn"} and all(us > 0 for us in overhead.values())
    assert len(lines) == 4 * len(TINY) and lines[0].startswith("steps gpt 1L/2H/16C T8 B4, 1 micro-batch(es) of 4: ")


def test_a_ranks_python_objects_are_its_devices_line_in_the_parameter_arrays_it_trains(shipped):
    """Each rank's plan holds the calibrated device's bytes of Python objects for the
    parameter arrays of its part (a pipeline stage's), at rest and at its peak; a
    published device (an accelerator's memory) none."""
    from mpitrain import plan as planner
    from mpitrain.config import from_dict
    from mpitrain.plan.data import DataShape

    cfg = from_dict({"model": {"name": "gpt", "n_layer": 4}, "data": {"name": "shakespeare"},
                     "train": {"steps": 1, "global_batch_size": 8}, "parallel": {"pp": 2}})
    data = DataShape("shakespeare", "text", (), 84, 1, 0, 10**6, "assumed")
    this = shipped.device("this")
    assert this.objects > 0 and this.objects_per_array > 0
    plan = planner.make(cfg, 2, planner.machine(shipped, "this", 2), data)
    for s, p in enumerate(plan.ranks):
        arrays = len(plan.layout.parameters(s))
        assert p.memory["objects"] == int(this.objects + this.objects_per_array * arrays)
        assert p.rest == p.state + p.memory["work"] + p.memory["buffers"] + p.memory["objects"]
    gpus = planner.make(cfg, 2, planner.machine(shipped, "a100-80g", 2, 2, "ib-hdr"), data)
    assert all(p.memory["objects"] == 0 for p in gpus.ranks)


def test_a_poisoned_user_catalogue_changes_no_tests_outcome(tmp_path):
    """A user's calibration in their home, and one named by $MPITRAIN_HARDWARE, both
    unreadable: outside the suite they break every plan; the suite's own tests that read
    the catalogue (a parameter server's queueing network, 'this' device's steps) pass as
    before, because the suite gives every test and process a home of its own
    (``tests/conftest.py``). (A calibration a busy machine wrote once failed the first.)"""
    import os
    import subprocess
    import sys
    from pathlib import Path

    home = tmp_path / "home"
    (home / ".config" / "mpitrain").mkdir(parents=True)
    poison = "[device.this]\nname = 'poisoned: not a table of numbers'\ngemm = [\n"  # not valid TOML
    (home / ".config" / "mpitrain" / "hardware.toml").write_text(poison)
    (tmp_path / "named.toml").write_text(poison)
    env = dict(os.environ, HOME=str(home), MPITRAIN_HARDWARE=str(tmp_path / "named.toml"))
    env.pop("XDG_CONFIG_HOME", None)
    read = [sys.executable, "-c", "from mpitrain.plan import hardware; hardware.load()"]
    outside = subprocess.run(read, env=env, capture_output=True, text=True, timeout=120)
    assert outside.returncode != 0 and "not valid TOML" in outside.stderr  # the poison works
    env.pop("MPITRAIN_HARDWARE")
    home_only = subprocess.run(read, env=env, capture_output=True, text=True, timeout=120)
    assert home_only.returncode != 0 and "not valid TOML" in home_only.stderr
    tests = Path(__file__).resolve().parent
    suite = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "0",
                            f"{tests / 'test_plan.py'}::test_the_queueing_network_of_parameter_servers_meets_its_bounds",
                            f"{tests / 'test_plan_hardware.py'}::test_measure_steps_times_tiny_models_per_family"],
                           env=dict(env, MPITRAIN_HARDWARE=str(tmp_path / "named.toml")), capture_output=True,
                           text=True, timeout=240, cwd=tests.parent)
    assert suite.returncode == 0 and "2 passed" in suite.stdout, suite.stdout + suite.stderr


def test_a_calibration_is_compared_with_the_shipped_one_of_its_kind(shipped, monkeypatch):
    """Calibration's closing comparison: its GEMM rates against the shipped calibration of
    this kind of machine, shape by shape; a warning where they are a tenth or more below
    (a slow spell the busy check cannot see); nothing to compare on another kind."""
    this = shipped.device("this")
    monkeypatch.setattr(hardware, "this_cpu", lambda: this.name.partition(";")[0].strip())
    rows = [[m, k, n, dtype, rate / 1e9, threads] for m, k, n, dtype, rate, threads in this.gemm]
    same = calibrate.against_shipped(rows)
    assert same.startswith("against the shipped calibration") and f"within 10% on {len(rows)} of {len(rows)}" in same
    slow = calibrate.against_shipped([[*r[:4], r[4] * 0.85, r[5]] for r in rows])
    assert slow.startswith("warning:") and "median 0.85 " in slow and "within 10% on 0 of" in slow
    monkeypatch.setattr(hardware, "this_cpu", lambda: "Another CPU, 64 cores")
    assert calibrate.against_shipped(rows).startswith("no shipped calibration of this kind of machine")


def test_the_catalogues_gpus_plan_and_carry_the_notes_sustained_figures(shipped):
    """Every published device plans GPT-2 on one GPU and on two nodes of eight (V100 in
    fp16: it has no bf16); the notes' sustained figures are in the catalogue (A100 280 of
    312 TFLOP/s, H100 813 of 989.5, an MI250X GCD 125 of 191.5: 90%, 82%, 65%) and the plan
    of a device prints its own; PCIe cards are paired by their NVLink bridge, more of them
    in a node join through PCIe."""
    from mpitrain import cli
    from mpitrain import plan as planner
    from mpitrain.plan import show

    gpus = [k for k, d in shipped.devices.items() if not d.calibrated]
    assert {"v100", "a100-40g", "a100-80g", "a100-40g-pcie", "a100-80g-pcie", "h100", "h100-nvl", "h200",
            "mi250x"} <= set(gpus)
    for key in gpus:
        precision = "fp16" if "bf16" not in shipped.device(key).peak_flops else "bf16"
        for layout in ([], ["--nodes", "2", "--gpus-per-node", "8", "--network", "ib-hdr"]):
            args = cli.build_parser().parse_args(["plan", "--model", "gpt2", "--hardware", key, *layout,
                                                  "--set", f"train.precision={precision}"])
            plan, _ = planner.from_args(args)
            assert plan.time["step"] > 0 and plan.layout.textbook, (key, layout)
    shares = {k: round(shipped.device(k).sustained["bf16"] / shipped.device(k).peak_flops["bf16"], 2)
              for k in ("a100-80g", "h100", "mi250x")}
    assert shares == {"a100-80g": 0.9, "h100": 0.82, "mi250x": 0.65}
    mi = shipped.device("mi250x")
    assert (mi.memory_bytes, mi.peak_flops["bf16"]) == (64e9, 383e12 / 2)  # one GCD: half the module
    args = cli.build_parser().parse_args(["plan", "--model", "gpt2", "--hardware", "h100", "--set",
                                          "train.precision=bf16"])
    header = show.header(planner.from_args(args)[0], "gpt2")
    assert ("(products at up to 794 TFLOP/s in bf16; sustained, as published: 813 TFLOP/s, 82% of its peak)"
            in header[2])
    pair, four = (planner.machine(shipped, "a100-80g-pcie", n) for n in (2, 4))
    assert (pair.intra.key, four.intra.key) == ("nvlink-bridge", "pcie4")


def test_a_device_names_the_link_inside_its_nodes_and_a_gpu_without_one_is_not_joined_by_a_guess(shipped, tmp_path):
    """Each shipped GPU names the link joining a node's GPUs (``intra``; PCIe cards their
    bridge too, ``pair``); a device of a user's catalogue may name its own, shipped or its
    file's. One that names none plans one rank a node (no link; the network between nodes),
    and more only with ``--intra``: never this machine's shared memory."""
    from mpitrain import plan as planner

    for key, device in shipped.devices.items():
        if not device.calibrated:
            assert device.intra in shipped.links, key
            assert planner.machine(shipped, key, 8).intra.key == device.intra
    assert {k: d.pair for k, d in shipped.devices.items() if d.pair} == dict.fromkeys(
        ("a100-40g-pcie", "a100-80g-pcie", "h100-nvl"), "nvlink-bridge")
    named = DEVICE.replace("[device.d", "[device.e").replace("memory_gb = 1", 'memory_gb = 1\nintra = "fast"')
    path = write(tmp_path, DEVICE.replace('name = "d"', 'name = "mine"') + named
                 + '[link.fast]\nname = "fast"\nalpha_us = 1\nbandwidth_gbs = 9\n')
    catalogue = hardware.load(path=path)
    assert planner.machine(catalogue, "e", 4).intra.key == "fast"
    alone = planner.machine(catalogue, "d", 1)
    assert alone.intra.key == "none" and alone.intra.seconds(1e9) == alone.intra.alpha == 0
    assert planner.machine(catalogue, "d", 2, 1, "ib-hdr").intra.key == "ib-hdr"  # one a node: the network only
    with pytest.raises(HardwareError, match=r"^device d \(mine\) names no link between the GPUs of a node: "
                                            r"--intra KEY for these 4 a node, or intra = \"KEY\" in its \[device.d\]"):
        planner.machine(catalogue, "d", 4)
    assert planner.machine(catalogue, "d", 4, intra="nvlink3").intra.key == "nvlink3"
    from mpitrain.plan import show

    plan = planner.make(load_config("jobs/shakespeare_gpt.toml"), 1, planner.machine(catalogue, "d", 1))
    assert "(every product at its fp32 peak, an upper bound: its entry gives no sms for the GPU model)" in \
        show.header(plan, "x")[2]


def test_the_pages_own_gpu_entry_loads_and_plans_a_node_of_eight(shipped, tmp_path):
    """plan/README.md's example of a user's own GPU (its measured product rate) is a
    catalogue that loads, and plans eight of them a node at that rate."""
    from mpitrain import plan as planner

    page = (Path(__file__).parents[1] / "mpitrain" / "plan" / "README.md").read_text(encoding="utf-8")
    block = page.split("```toml\n[device.a100-ours]\n", 1)[1].split("```", 1)[0]
    catalogue = hardware.load(path=write(tmp_path, "[device.a100-ours]\n" + block))
    ours = planner.machine(catalogue, "a100-ours", 16, 8, "ib-hdr")
    assert ours.intra.key == "nvlink3" and ours.device.achievable["bf16"] == 240e12
