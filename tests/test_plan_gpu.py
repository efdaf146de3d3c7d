"""The GPU model (mpitrain/plan/gpu.py): a transformer block's kernels as rooflines, what a
GPU framework holds, and how a GPU's plan uses them (mpitrain/plan/space.py)."""

import subprocess
import sys

import pytest

from mpitrain import cost
from mpitrain.plan import gpu, hardware, space


@pytest.fixture(scope="module")
def a100():
    return hardware.load().device("a100-80g")


def test_a_large_products_backward_is_twice_its_forward_and_quantisation_costs_waves(a100):
    """A square product's two backward products take twice its forward (the weights'
    gradient also reads and writes float32 sums, hidden under its arithmetic); a shape one
    tile wider than a wave takes a wave more."""
    forward, backward = gpu.trained_gemm(a100, "bf16", 8192, 8192, 8192)
    assert backward == pytest.approx(2 * forward, rel=1e-12)
    assert forward == pytest.approx(2 * 8192**3 / 271.2e12, rel=0.02)  # 64 x 32 tiles: 19 waves of 108, 2048 tiles
    one = gpu.gemm_seconds(a100, "bf16", 256 * 12, 4096, 128 * 9)  # 108 tiles: one wave
    assert gpu.gemm_seconds(a100, "bf16", 256 * 12, 4096, 128 * 9 + 1) == pytest.approx(1.5 * one)


def test_a_blocks_memory_bound_kernels_shrink_with_sequence_parallelism_and_flash_attention(a100):
    """With sequence parallelism the norms and the dropout-adds touch a slice's share of
    the sequence (the products are the same); FlashAttention keeps no scores, so its
    attention is faster at a long context and the rest of the block is unchanged;
    selective recomputation runs attention's core forward once more in backward."""
    args = (a100, "fp16", 4, 2048, 6144, 64, 8)
    plain, sliced = gpu.block_seconds(*args), gpu.block_seconds(*args, sequence=True)
    stream = 4 * 2048 * 6144 * 2  # one 16-bit copy of the residual stream
    norms = 2 * gpu.moved_seconds(a100, 2 * stream) + 2 * gpu.moved_seconds(a100, (3 * 2 + 1) / 2 * stream)
    saved = norms * (1 - 1 / 8)
    assert plain["forward"] - sliced["forward"] == pytest.approx(saved, rel=1e-9)
    flash = gpu.block_seconds(*args, flash=True)
    assert flash["attention"] < plain["attention"] / 2
    assert flash["forward"] - flash["attention"] == pytest.approx(plain["forward"] - plain["attention"], rel=1e-12)
    model = space.Gpt(51200, 2048, 48, 64, 6144, 4, dropout=True)
    selective = space.Gpt(51200, 2048, 48, 64, 6144, 4, dropout=True, selective=True)
    N = 22e9 / 8
    runs = [gpu.stage_seconds(a100, g, "fp16", 4, 1, 8, 48, True, True, N, N, False, False)[0]
            for g in (model, selective)]
    flash = gpu.block_seconds(*args, flash=True)["attention"]  # the causal half at 60% of the peak
    assert flash == pytest.approx(4 * cost.attention_flops(1, 2048, 6144) / 8 / 2 / (0.6 * 312e12))
    assert runs[1] - runs[0] == pytest.approx(48 * plain["attention"], rel=1e-9)


def test_gradient_accumulation_and_the_update_move_their_bytes(a100):
    """Without the products' fused accumulation, each micro-batch's gradients go into float32
    sums where the framework keeps them (mixed precision, ddp or ZeRO-1: each gradient read,
    the sum read and written), else PyTorch's autograd adds them from the second on (three
    16-bit words a parameter; ``train.accumulation = "16-bit"``, which then holds 16-bit
    gradients); the fused Adam update with its checks moves 38 bytes a parameter in mixed
    precision, 36 in float32, once a step."""
    N = 1e9
    assert gpu.main_grads("ddp", "bf16") and gpu.main_grads("zero1", "fp16") and not gpu.main_grads("zero2", "bf16")
    assert not gpu.main_grads("ddp", "fp32") and not gpu.main_grads("ddp", "fp16", "16-bit")
    state = cost.model_state_bytes(1, 1, 1, 2, 4, True)
    assert sum(gpu.as_frameworks_hold(state, "ddp", True, "16-bit").values()) == 16  # the ZeRO paper's
    assert gpu.accumulation_seconds(a100, "bf16", N, 1) == 0
    assert gpu.accumulation_seconds(a100, "bf16", N, 5) == pytest.approx(4 * N * 6 / a100.stream_bandwidth)
    assert gpu.accumulation_seconds(a100, "bf16", N, 5, main=True) == pytest.approx(5 * N * 10 / a100.stream_bandwidth)
    assert gpu.update_seconds(a100, "bf16", N) == pytest.approx(N * 38 / a100.stream_bandwidth)
    assert gpu.update_seconds(a100, "fp32", N) == pytest.approx(N * 36 / a100.stream_bandwidth)
    model = space.Gpt(51200, 2048, 48, 64, 6144, 4, dropout=True)
    compute, _, once = gpu.stage_seconds(a100, model, "fp16", 4, 1, 8, 48, True, True, 2.75e9, 2.75e9 / 8, False,
                                         False, "zero1")
    assert once == pytest.approx(gpu.update_seconds(a100, "fp16", 2.75e9 / 8))  # once a step, outside the schedule


def _pure_dp(sync: str, precision: str, accumulation: str):
    """The plan of a 1.3 B GPT on 16 A100s over two nodes, data parallel only."""
    import argparse

    from mpitrain import plan as planner

    sets = {"model.n_layer": 24, "model.n_head": 16, "model.n_embd": 2048, "model.block_size": 2048,
            "model.vocab_size": 51200, "train.global_batch_size": 256, "train.precision": precision,
            "train.accumulation": accumulation, "parallel.sync": sync}
    args = argparse.Namespace(config=None, model="gpt2", set=[f"{k}={v}" for k, v in sets.items()],
                              hardware="a100-80g", ranks=16, nodes=2, per_node=8, network="ib-hdr", intra=None,
                              memory_per_rank=None, catalogue=None, mfu=None)
    return planner.from_args(args)[0]


def test_a_frameworks_data_parallelism_sums_the_gradients_it_keeps():
    """In bf16, float32 gradients where the framework keeps them (Megatron-LM's
    accumulate_allreduce_grads_in_fp32, DeepSpeed's bf16 optimizer): ddp's allreduce moves
    twice the bytes in twice the buckets; ZeRO-1's reduce-scatter twice, its gather of
    16-bit parameters the same (1.5 x in all). In fp16 (Megatron-LM's default), with
    16-bit sums, and with ZeRO-2: the 16-bit gradients."""
    assert gpu.synced_word("ddp", "bf16") == 4 and gpu.synced_word("zero1", "bf16", "float32") == 4
    assert gpu.synced_word("ddp", "fp16") == 2 and gpu.synced_word("ddp", "bf16", "16-bit") == 2
    assert gpu.synced_word("zero2", "bf16") == 2 and gpu.synced_word("ddp", "fp32") == 4
    for sync, ratio in (("ddp", 2.0), ("zero1", 1.5)):
        kept, summed = (_pure_dp(sync, "bf16", a).time["comm_total"] for a in ("fused", "16-bit"))
        assert kept / summed == pytest.approx(ratio, rel=1e-3)
        assert _pure_dp(sync, "fp16", "fused").time["comm_total"] == pytest.approx(summed, rel=1e-12)


@pytest.mark.parametrize("sync, dp, per_parameter", [("ddp", 1, 18), ("zero1", 8, 6 + 12 / 8), ("zero2", 8, 2 + 14 / 8),
                                                      ("zero3", 8, 16 / 8)])
def test_a_gpu_framework_holds_megatrons_or_deepspeeds_state_and_its_allowance(sync, dp, per_parameter):
    """Mixed precision with Adam: Megatron-LM's 18 bytes a parameter (float32 gradients),
    6 + 12/d with its distributed optimizer (ZeRO-1); DeepSpeed's ZeRO-2 and -3 as the
    ZeRO paper counts them; the framework's allowance: the CUDA context, NCCL's buffers per
    communicator, cuBLAS's workspace and 5% of what the rank holds."""
    state = cost.model_state_bytes(*cost.state_shares(sync, dp), 2, 4, True)
    held = gpu.held({**state, "activations": 1e9}, sync, True, 2)
    assert sum(held[k] for k in state) == pytest.approx(per_parameter)
    total = sum(state.values()) + (sum(held[k] for k in state) - sum(state.values())) + 1e9
    assert held["framework"] == pytest.approx(400e6 + 2 * 688e6 + 32 * 2**20 + 0.05 * total)


def test_utilization_is_refused_naming_what_replaced_it():
    out = subprocess.run([sys.executable, "-m", "mpitrain", "plan", "--model", "gpt2", "--hardware", "h100",
                          "--utilization", "0.5"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and out.stderr.count("replaced:") == 1  # once, after argparse's usage
    assert "--utilization: replaced: a GPU's products are now timed kernel by kernel" in out.stderr
    assert "--mfu SHARE sets the whole step's model FLOPs utilization" in out.stderr
