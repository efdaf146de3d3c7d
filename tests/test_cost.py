"""The cost formulas (unit tier): against the published figures they come from, and against
each other where two of them must agree. What the runs measure is held against them
elsewhere (bytes by the communicators' counters, memory by the arrays and the heap,
FLOPs by counting a real step: tests/test_flops.py, test_mpi_*.py)."""

import pytest

from mpitrain import cost

GiB, MiB = 2**30, 2**20


def test_a_training_runs_compute_in_pflops_days():
    """The ResNet example: 11.4e9 multiply-adds forward, backward twice that, 1.2 M images,
    128 epochs: about 10 EFLOP, which is about 0.12 PFLOP/s-days."""
    forward = 2 * 11.4e9
    per_image = forward + cost.backward_flops(forward, 2)
    total = per_image * 1.2e6 * 128
    assert total == pytest.approx(1.05e19, rel=1e-3)
    assert cost.pflops_days(1e19) == pytest.approx(0.1157, rel=1e-3)
    assert cost.machine_seconds(total, 8, 125e12, 0.4) == pytest.approx(total / 4e14)


def test_the_storage_bandwidth_that_keeps_an_accelerator_busy():
    """Ibrahim et al.'s calculator: CosmoFlow (247 GiFLOP and 16 MiB a sample) at the
    35-50 TFLOP/s a V100 reaches needs 2.2-3.3 GB/s of storage per GPU."""
    low = cost.accelerator_storage_bandwidth(16 * MiB, 247 * GiB, 35e12)
    high = cost.accelerator_storage_bandwidth(16 * MiB, 247 * GiB, 50e12)
    assert (round(low / 1e9, 1), round(high / 1e9, 1)) == (2.2, 3.2)
    assert cost.storage_bandwidth(65, 12_000) == 780_000  # bytes a sample x samples a second


def test_model_state_per_parameter():
    """16 bytes a parameter for Adam in mixed precision (a trillion parameters: 16 TB),
    divided by ZeRO's stages as its paper tabulates them."""
    assert cost.bytes_per_parameter("ddp", 64, mixed=True) * 1e12 == 16e12
    for P in (1, 4, 64):
        assert cost.bytes_per_parameter("zero3", P) * P == cost.bytes_per_parameter("ddp", P)
        assert cost.bytes_per_parameter("zero1", P) == 4 + 4 + 8 / P
        assert cost.bytes_per_parameter("zero2", P) == 4 + (4 + 8) / P


@pytest.mark.parametrize("P", [1, 2, 3, 4, 7, 16])
@pytest.mark.parametrize("n", [1, 5, 1000, 4099])
def test_collectives_add_up(n, P):
    """The ring's exact count sums to 2(P-1) n over the ranks; an allreduce is a
    reduce-scatter and an allgather; ZeRO-1 sends what data parallelism sends."""
    assert sum(cost.ring_elements(n, P, r) for r in range(P)) == 2 * (P - 1) * n
    assert cost.collective_bytes("allreduce", n, P) == pytest.approx(
        cost.collective_bytes("reduce_scatter", n, P) + cost.collective_bytes("allgather", n, P))
    assert cost.zero_bytes(1, 4 * n, P) == pytest.approx(cost.data_parallel_bytes(n, P, 4))
    assert cost.zero_bytes(2, 4 * n, P, micro_batches=1) == pytest.approx(cost.zero_bytes(1, 4 * n, P))
    half = cost.collective_bytes("allgather", 4 * n, P)  # ZeRO-3: 2m gathers + m reduce-scatters, 3m + m split,
    assert cost.zero_bytes(3, 4 * n, P, micro_batches=4) == pytest.approx(12 * half)  # once each per step
    assert cost.zero_bytes(3, 4 * n, P, micro_batches=4, split=True) == pytest.approx(16 * half)
    assert cost.zero_bytes(3, 4 * n, P, micro_batches=4, gather="step") == pytest.approx(cost.zero_bytes(1, 4 * n, P))
    assert cost.data_parallel_bytes(n, P, 4, wire=2, algorithm="ring") * 2 == pytest.approx(
        cost.data_parallel_bytes(n, P, 4, algorithm="ring"))
    assert cost.data_parallel_bytes(n, P, 2, algorithm="mpi") == pytest.approx(cost.data_parallel_bytes(n, P, 4))
    shares = cost.node_aware_bytes(8 * n, nodes=P, per_node=2)
    assert shares["inter-node"] == pytest.approx(cost.collective_bytes("allreduce", 4 * n, P))


def test_pipeline_formulas_of_one_stage_and_of_one_chunk():
    assert cost.bubble_fraction("1f1b", 1, 8) == 0
    assert cost.bubble_fraction("gpipe", 4, 12) == pytest.approx(3 / 15)
    assert cost.bubble_fraction("interleaved", 4, 8, 2) < cost.bubble_fraction("1f1b", 4, 8)
    assert [cost.micro_batches_held("interleaved", 4, 8, r, 1) for r in range(4)] == \
        [cost.micro_batches_held("1f1b", 4, 8, r) for r in range(4)] == [4, 3, 2, 1]


def test_activations_sliced_over_one_rank_are_the_whole_blocks():
    """Korthikanti et al.: s b h (34 + 5 a s / h) per block; sliced over t ranks
    10 + 24/t of the 34 stay whole on each rank, all of it over t with sequence
    parallelism; the float32 ratios of mpitrain's blocks are 1 on one rank."""
    s, b, h, a = 2048, 1, 12288, 96
    whole = s * b * h * (34 + 5 * a * s / h)
    assert cost.transformer_block_activation_bytes(s, b, h, a) == pytest.approx(whole)
    assert cost.transformer_block_activation_bytes(s, b, h, a, t=8, sequence=True) == pytest.approx(whole / 8)
    assert cost.transformer_block_activation_bytes(s, b, h, a, t=8) > whole / 8
    assert cost.sliced_activation_ratios(1, 4, 64, 128) == pytest.approx((1.0, 1.0))
    ours = cost.gpt_block_activation_bytes(12, 64, 128, 4, 4)
    assert cost.gpt_block_activation_bytes(12, 64, 128, 4, 4, checkpointed=True) == 12 * 64 * 128 * 4 < ours


def test_a_gpt_step_is_about_six_flops_per_parameter_and_token():
    """Megatron's count of a step against Kaplan's 6 N D, for a GPT whose attention and
    vocabulary are small beside its width: within a few per cent."""
    B, T, C, L, V = 8, 128, 2048, 24, 512
    params = L * 12 * C * C + V * C
    assert cost.gpt_step_flops(B, T, C, L, V) == pytest.approx(cost.dense_training_flops(params, B * T), rel=0.05)


def test_selective_recomputation_keeps_all_but_attentions_scores():
    """Korthikanti et al. 2022, section 5: with sequence parallelism and selective
    recomputation a block keeps 34 s b h / t bytes (16-bit): the 5 a s^2 b of the scores,
    softmax and its dropout mask recomputed; without sequence parallelism s b h (10 + 24/t)."""
    s, b, h, a, t = 2048, 1, 12288, 96, 8
    assert cost.transformer_block_activation_bytes(s, b, h, a, t, sequence=True, selective=True) == \
        pytest.approx(34 * s * b * h / t)
    assert cost.transformer_block_activation_bytes(s, b, h, a, t, selective=True) == \
        pytest.approx(s * b * h * (10 + 24 / t))
