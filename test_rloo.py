"""Tests of rloo.py.

Unit tests (the sections without the `slow` mark) check the pure functions of the trainer against numbers derived
by hand or from plain-Python loops written here, never against output copied from a run. Every test that starts a
process is marked `slow`: the distributed statistics checked with two gloo processes, the command-line checks, and
the end-to-end tests, which run rloo.py in subprocesses: one process (`python rloo.py`, or the README's main command
under `accelerate launch`), and two processes under DeepSpeed ZeRO-3 and under DDP through `accelerate launch`, on
the CPU over gloo. No GPU, no network:

    HF_HUB_OFFLINE=1 python -m pytest -q -m "not slow" test_rloo.py     # the unit tests, under 20 seconds
    HF_HUB_OFFLINE=1 python -m pytest -q test_rloo.py                   # everything, as CI runs it
"""

import copy
import dataclasses
import json
import math
import os
import pathlib
import re
import signal
import socket
import statistics
import subprocess
import sys
import time
import types

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import tyro
from torch.testing import assert_close

import rloo

ROOT = pathlib.Path(__file__).resolve().parent  # the repository
RLOO_PY = str(ROOT / "rloo.py")
slow = pytest.mark.slow


def subprocess_env(pythonpath=ROOT, **extra):
    """The environment of every subprocess: offline, one thread per process, DeepSpeed on its CPU accelerator."""
    env = dict(
        os.environ,
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        DS_ACCELERATOR="cpu",
        OMP_NUM_THREADS="1",
        TOKENIZERS_PARALLELISM="false",
        COLUMNS="200",
        PYTHONPATH=str(pythonpath),
        **extra,
    )
    env.pop("PYTHONSTARTUP", None)
    return env


# ----------------------------------------------------------------------------------------------------------------
# 1. rloo_advantages


def loo_reference(rewards, k):
    """The leave-one-out advantage by an explicit double loop over prompts and samples (k-major layout)."""
    rewards = [float(r) for r in rewards]
    B = len(rewards) // k
    out = [None] * len(rewards)
    for j in range(B):  # prompt j
        rows = [i * B + j for i in range(k)]
        for row in rows:
            others = [rewards[o] for o in rows if o != row]
            out[row] = rewards[row] - sum(others) / (k - 1)
    return out


@pytest.mark.parametrize("k,B", [(2, 1), (2, 5), (3, 4), (4, 3), (8, 2)])
def test_rloo_advantages_match_double_loop(k, B):
    g = torch.Generator().manual_seed(100 * k + B)
    rewards = torch.randn(k * B, generator=g, dtype=torch.float64) * 3 + 1
    got = rloo.rloo_advantages(rewards, k)
    assert got.shape == (k * B,)
    assert_close(got, torch.tensor(loo_reference(rewards, k), dtype=torch.float64))
    # each prompt's k advantages sum to zero: S - (k S - S) / (k - 1) = 0 with S the prompt's reward sum
    assert_close(got.view(k, B).sum(0), torch.zeros(B, dtype=torch.float64), atol=1e-12, rtol=0)


def test_rloo_advantages_trl_hand_values():
    rewards = torch.tensor([1, 2, 3, 2, 3, 4, 5, 6, 7, 8, 9, 10], dtype=torch.float64)
    got = rloo.rloo_advantages(rewards, 4)
    # prompt j has samples at rows j, 3+j, 6+j, 9+j; A = r - (S - r)/3 with S = 16, 20, 24 for j = 0, 1, 2
    expected = [-4, -4, -4, -8 / 3, -8 / 3, -8 / 3, 4 / 3, 4 / 3, 4 / 3, 16 / 3, 16 / 3, 16 / 3]
    assert_close(got, torch.tensor(expected, dtype=torch.float64))
    assert got[0].item() == pytest.approx(-4.0)
    assert got[7].item() == pytest.approx(4 / 3)


def test_rloo_advantages_layout_is_k_major():
    # k=2, B=2: rows 0, 2 are prompt 0 and rows 1, 3 prompt 1; a prompt-major reading would pair rows 0 and 1
    got = rloo.rloo_advantages(torch.tensor([0.0, 10.0, 1.0, 30.0]), 2)
    assert_close(got, torch.tensor([-1.0, -20.0, 1.0, 20.0]))


# ----------------------------------------------------------------------------------------------------------------
# 2. policy_loss


def test_policy_loss_sequence_mode_by_hand():
    eps = 0.2
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 0], [1, 0, 0]], dtype=torch.bool)
    diffs = torch.tensor([[0.1, 0.2, 0.0], [0.05, -0.02, 0.01], [-0.5, 0.0, 0.0], [-0.3, 0.0, 0.0], [0.4, 0.0, 0.0]])
    old = torch.tensor(
        [[-1.0, -2.0, -0.5], [-0.3, -1.5, -2.5], [-0.7, -1.1, -0.2], [-2.0, -0.4, -0.9], [-1.2, -3.0, -0.6]]
    )
    new = (old + diffs).requires_grad_()
    adv = torch.tensor([2.0, -1.0, -1.0, 3.0, -0.5])
    loss, clipfrac = rloo.policy_loss(new, old, adv, mask, eps)
    # row: log ratio, A -> unclipped -A r, clipped -A clip(r), the max, clipped wins?
    # 0: 0.3,   A=2    -> -2 e^.3 = -2.6997, -2*1.2 = -2.4        -> -2.4, clipped
    # 1: 0.04,  A=-1   -> e^.04 = 1.0408 both (inside the range)  -> 1.0408, not clipped
    # 2: -0.5,  A=-1   -> e^-.5 = 0.6065, 0.8                     -> 0.8, clipped
    # 3: -0.3,  A=3    -> -3 e^-.3 = -2.2225, -3*0.8 = -2.4       -> -2.2225, not clipped
    # 4: 0.4,   A=-0.5 -> 0.5 e^.4 = 0.7459, 0.5*1.2 = 0.6        -> 0.7459, not clipped
    terms = [-2.4, math.exp(0.04), 0.8, -3 * math.exp(-0.3), 0.5 * math.exp(0.4)]
    assert loss.item() == pytest.approx(sum(terms) / 5, rel=1e-5)
    assert clipfrac.item() == pytest.approx(2 / 5)
    loss.backward()
    # d loss / d logp_t = -A r / N on the real tokens of unclipped rows, 0 on clipped rows and on padding
    row_grad = [0.0, math.exp(0.04), 0.0, -3 * math.exp(-0.3), 0.5 * math.exp(0.4)]
    expected = torch.tensor(row_grad)[:, None] / 5 * mask.float()
    assert_close(new.grad, expected)


def test_policy_loss_token_mode_by_hand():
    eps = 0.2
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)
    diffs = torch.tensor([[0.3, -0.1, -0.4], [0.5, -0.5, 0.0]])
    old = torch.tensor([[-1.0, -0.2, -3.0], [-0.6, -1.4, -0.8]])
    new = (old + diffs).requires_grad_()
    adv = torch.tensor([[1.0, 2.0, -1.0], [-2.0, 0.5, 0.0]])
    loss, clipfrac = rloo.policy_loss(new, old, adv, mask, eps)
    # (0,0): r=e^.3,  A=1   -> -1.3499 vs -1.2          -> -1.2 clipped
    # (0,1): r=e^-.1, A=2   -> -1.8097 both             -> not clipped
    # (0,2): r=e^-.4, A=-1  -> 0.6703 vs 0.8            -> 0.8 clipped
    # (1,0): r=e^.5,  A=-2  -> 3.2974 vs 2.4            -> 3.2974 not clipped
    # (1,1): r=e^-.5, A=0.5 -> -0.3033 vs -0.4          -> -0.3033 not clipped
    terms = [-1.2, -2 * math.exp(-0.1), 0.8, 2 * math.exp(0.5), -0.5 * math.exp(-0.5)]
    assert loss.item() == pytest.approx(sum(terms) / 5, rel=1e-5)
    assert clipfrac.item() == pytest.approx(2 / 5)
    loss.backward()
    expected = torch.tensor([[0.0, -2 * math.exp(-0.1), 0.0], [2 * math.exp(0.5), -0.5 * math.exp(-0.5), 0.0]]) / 5
    assert_close(new.grad, expected)


def test_policy_loss_ratio_one_is_minus_mean_advantage():
    # new == old: ratio 1, nothing clipped, loss = -mean(A) (sequence) / -mean over real tokens (token mode)
    g = torch.Generator().manual_seed(0)
    logp = -torch.rand(4, 6, generator=g)
    mask = torch.arange(6)[None, :] < torch.tensor([[6], [1], [3], [4]])
    adv = torch.randn(4, generator=g)
    loss, clipfrac = rloo.policy_loss(logp, logp, adv, mask, 0.2)
    assert_close(loss, -adv.mean())
    assert clipfrac.item() == 0.0
    adv_t = torch.randn(4, 6, generator=g)
    loss, clipfrac = rloo.policy_loss(logp, logp, adv_t, mask, 0.2)
    assert_close(loss, -adv_t[mask].sum() / mask.sum())
    assert clipfrac.item() == 0.0


@pytest.mark.parametrize("token_mode", [False, True])
def test_policy_loss_ignores_garbage_at_masked_positions(token_mode):
    g = torch.Generator().manual_seed(3)
    N, T = 5, 6
    mask = torch.arange(T)[None, :] < torch.tensor([[6], [1], [3], [4], [2]])
    old = -torch.rand(N, T, generator=g) * 2
    new = old + torch.randn(N, T, generator=g) * 0.3  # some ratios leave [0.8, 1.2], some do not
    adv = torch.randn(N, T, generator=g) if token_mode else torch.randn(N, generator=g)

    def run(new, old, adv):
        new = new.clone().requires_grad_()
        loss, clipfrac = rloo.policy_loss(new, old, adv, mask, 0.2)
        loss.backward()
        return loss.detach(), clipfrac, new.grad

    clean = run(
        torch.where(mask, new, 0.0), torch.where(mask, old, 0.0), torch.where(mask, adv, 0.0) if token_mode else adv
    )
    assert 0.0 < clean[1].item() < 1.0  # the case exercises both sides of the clip
    garbage = torch.tensor([math.inf, -math.inf, math.nan, 1e9, -1e9, math.nan])
    fill = garbage.repeat(N * T // len(garbage) + 1)[: N * T].view(N, T)
    fill_old = fill.roll(1, dims=1)  # different garbage in old: inf - inf, nan - 1e9, ...
    dirty_adv = torch.where(mask, adv, fill.roll(2, dims=1)) if token_mode else adv
    dirty = run(torch.where(mask, new, fill), torch.where(mask, old, fill_old), dirty_adv)
    assert torch.isfinite(clean[0]) and torch.isfinite(dirty[0])
    assert_close(dirty[0], clean[0], rtol=0, atol=0)
    assert_close(dirty[1], clean[1], rtol=0, atol=0)
    assert torch.isfinite(dirty[2]).all()
    assert_close(dirty[2][mask], clean[2][mask], rtol=0, atol=0)
    assert (dirty[2][~mask] == 0).all()
    assert (clean[2][mask] != 0).any()


# ----------------------------------------------------------------------------------------------------------------
# 3. truncate_response and first_true_indices


def test_first_true_indices():
    bools = torch.tensor([[0, 1, 0, 1], [0, 0, 0, 0], [1, 0, 0, 0], [0, 0, 0, 1]], dtype=torch.bool)
    assert rloo.first_true_indices(bools).tolist() == [1, 4, 0, 3]


def test_truncate_response_pad_equals_stop():
    eos = pad = 0
    responses = torch.tensor([[5, 0, 7, 0], [3, 4, 6, 8], [0, 2, 3, 4], [1, 2, 3, 0]])
    out, mask = rloo.truncate_response(responses, eos, pad)
    assert out.tolist() == [[5, 0, 0, 0], [3, 4, 6, 8], [0, 0, 0, 0], [1, 2, 3, 0]]
    # the stop token is real even though it has the pad id; a row without a stop keeps everything
    assert mask.tolist() == [[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 1, 1]]
    assert mask.dtype == torch.bool


def test_truncate_response_distinct_pad():
    responses = torch.tensor([[5, 2, 7, 2, 9], [3, 4, 6, 8, 1], [2, 2, 3, 4, 5]])
    out, mask = rloo.truncate_response(responses, 2, 99)
    assert out.tolist() == [[5, 2, 99, 99, 99], [3, 4, 6, 8, 1], [2, 99, 99, 99, 99]]
    assert mask.tolist() == [[1, 1, 0, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]]


def test_truncate_response_without_stop_token_keeps_everything():
    responses = torch.tensor([[5, 0, 7, 0], [0, 0, 0, 0]])
    out, mask = rloo.truncate_response(responses, None, 0)
    assert out.tolist() == responses.tolist()
    assert mask.all() and mask.shape == responses.shape


# ----------------------------------------------------------------------------------------------------------------
# 4. token_level_advantages


def token_advantages_reference(scores, kl, mask, kl_coef, k):
    """A_t = LOO(score) - kl_coef * sum_{t' >= t, real} kl_t', by loops; None at padding."""
    loo = loo_reference(scores, k)
    out = []
    for n in range(len(scores)):
        row = []
        for t in range(kl.shape[1]):
            if not mask[n, t]:
                row.append(None)
                continue
            to_go = sum(float(kl[n, u]) for u in range(t, kl.shape[1]) if mask[n, u])
            row.append(loo[n] - kl_coef * to_go)
        out.append(row)
    return out


def assert_real_positions(got, expected_rows, mask):
    expected = torch.tensor([[0.0 if v is None else v for v in row] for row in expected_rows], dtype=got.dtype)
    assert_close(got[mask], expected[mask])


def test_token_level_advantages_by_hand():
    scores = torch.tensor([1.0, 3.0])  # k=2, B=1: LOO = [-2, 2]
    kl = torch.tensor([[0.1, 0.2, 0.3], [0.4, 0.5, 99.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)
    got = rloo.token_level_advantages(scores, kl, mask, 0.5, 2)
    assert got.shape == (2, 3)
    # row 0: -2 - 0.5 * [0.6, 0.5, 0.3]; row 1: 2 - 0.5 * [0.9, 0.5]
    assert_close(got[0], torch.tensor([-2.3, -2.25, -2.15]))
    assert_close(got[1, :2], torch.tensor([1.55, 1.75]))


def test_token_level_advantages_k2_b2_by_hand():
    scores = torch.tensor([1.0, 0.0, 2.0, 4.0])  # rows 0, 2 prompt 0 (LOO -1, 1); rows 1, 3 prompt 1 (-4, 4)
    kl = torch.tensor([[1.0, 2.0], [0.5, 7.0], [3.0, 1.0], [2.0, 2.0]])
    mask = torch.tensor([[1, 1], [1, 0], [1, 1], [1, 1]], dtype=torch.bool)
    got = rloo.token_level_advantages(scores, kl, mask, 0.1, 2)
    assert_close(got[0], torch.tensor([-1 - 0.3, -1 - 0.2]))
    assert_close(got[1, 0], torch.tensor(-4 - 0.05))
    assert_close(got[2], torch.tensor([1 - 0.4, 1 - 0.1]))
    assert_close(got[3], torch.tensor([4 - 0.4, 4 - 0.2]))


@pytest.mark.parametrize("k,B", [(2, 3), (3, 2), (4, 1)])
def test_token_level_advantages_match_loops_and_ignore_masked_kl(k, B):
    g = torch.Generator().manual_seed(7 * k + B)
    N, T = k * B, 5
    scores = torch.randn(N, generator=g, dtype=torch.float64)
    kl = torch.rand(N, T, generator=g, dtype=torch.float64)
    lengths = torch.randint(1, T + 1, (N, 1), generator=g)
    mask = torch.arange(T)[None, :] < lengths
    got = rloo.token_level_advantages(scores, kl, mask, 0.3, k)
    assert_real_positions(got, token_advantages_reference(scores, kl, mask, 0.3, k), mask)
    garbage = torch.tensor([math.nan, math.inf, -math.inf, 1e9], dtype=torch.float64).repeat(N * T)[: N * T].view(N, T)
    dirty = rloo.token_level_advantages(scores, torch.where(mask, kl, garbage), mask, 0.3, k)
    assert_close(dirty[mask], got[mask], rtol=0, atol=0)


def test_token_level_advantages_whiten_rewards_only_rescales():
    # whiten_rewards: the per-token rewards r_t = -c kl_t (+ score at the last real token) are divided by
    # s = sqrt(unbiased variance over real tokens + 1e-8), unshifted: every advantage is the plain one / s
    g = torch.Generator().manual_seed(3)
    k, B, T, c = 2, 2, 4, 0.2
    N = k * B
    scores = torch.randn(N, generator=g, dtype=torch.float64) * 2
    kl = torch.rand(N, T, generator=g, dtype=torch.float64)
    mask = torch.arange(T)[None, :] < torch.tensor([[4], [2], [3], [1]])
    got = rloo.token_level_advantages(scores, kl, mask, c, k, whiten_rewards=True)
    last = [int(mask[n].sum()) - 1 for n in range(N)]
    r = [
        -c * float(kl[n, t]) + (float(scores[n]) if t == last[n] else 0.0)
        for n in range(N)
        for t in range(T)
        if mask[n, t]
    ]
    s = math.sqrt(statistics.variance(r) + 1e-8)
    assert_real_positions(got, token_advantages_reference(scores / s, kl / s, mask, c, k), mask)


def test_token_level_whitening_adds_no_length_reward():
    # equal scores and no KL: nothing tells the two completions apart, whatever their lengths (2 and 8 tokens);
    # shifting the whitened rewards by their mean would give each real token a constant, summed by the KL-to-go
    scores, kl = torch.tensor([1.0, 1.0]), torch.zeros(2, 8)
    mask = torch.arange(8)[None, :] < torch.tensor([[2], [8]])
    got = rloo.token_level_advantages(scores, kl, mask, 0.05, 2, whiten_rewards=True)
    assert got[mask].abs().max().item() == 0.0


# ----------------------------------------------------------------------------------------------------------------
# 5. whiten and global_mean_var: one process, then two


def test_whiten_single_process():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(4, 5, generator=g, dtype=torch.float64) * 3 + 2
    ref = (x - x.mean()) / torch.sqrt(x.var(unbiased=True) + 1e-8)
    assert_close(rloo.whiten(x), ref)
    assert_close(rloo.whiten(x, shift_mean=False), ref + x.mean())
    mean, var = rloo.global_mean_var(x)
    assert_close(mean, x.mean())
    assert_close(var, x.var(unbiased=True))


def test_whiten_masked_single_process():
    g = torch.Generator().manual_seed(6)
    x = torch.randn(4, 5, generator=g, dtype=torch.float64) * 3 + 2
    mask = torch.rand(4, 5, generator=g) < 0.6
    x = torch.where(mask, x, 1e6)  # the padding is huge: any leak shows
    real = [float(v) for v in x[mask]]
    m, v = statistics.mean(real), statistics.variance(real)
    mean, var = rloo.global_mean_var(x, mask)
    assert mean.item() == pytest.approx(m, rel=1e-12)
    assert var.item() == pytest.approx(v, rel=1e-12)
    ref = (x[mask] - m) / math.sqrt(v + 1e-8)
    assert_close(rloo.whiten(x, mask)[mask], ref)
    assert_close(rloo.whiten(x, mask, shift_mean=False)[mask], ref + m)


def _whiten_worker(rank, init_file, out_dir, values, mask):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        half = values.shape[0] // 2
        local, local_mask = values[rank * half : (rank + 1) * half], mask[rank * half : (rank + 1) * half]
        mean_m, var_m = rloo.global_mean_var(local, local_mask)
        mean_a, var_a = rloo.global_mean_var(local)
        result = {
            "mean_masked": mean_m,
            "var_masked": var_m,
            "mean_all": mean_a,
            "var_all": var_a,
            "whiten_masked": rloo.whiten(local, local_mask),
            "whiten_masked_keep_mean": rloo.whiten(local, local_mask, shift_mean=False),
            "whiten_all": rloo.whiten(local),
            "sum": rloo.all_reduce_sum(torch.tensor([float(rank + 1)])),
        }
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@slow
def test_whiten_and_global_mean_var_across_two_processes(tmp_path):
    g = torch.Generator().manual_seed(8)
    values = torch.randn(6, 4, generator=g, dtype=torch.float64) * 2 - 1
    mask = torch.zeros(6, 4, dtype=torch.bool)
    mask[:3] = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0], [1, 1, 1, 0]], dtype=torch.bool)  # rank 0: 10 real
    mask[3:] = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 0, 0]], dtype=torch.bool)  # rank 1: 3 real
    values = torch.where(mask, values, 50.0)  # padding far from the data: any leak shows
    context = mp.spawn(_whiten_worker, args=(str(tmp_path / "init"), str(tmp_path), values, mask), nprocs=2, join=False)
    deadline = time.monotonic() + 120
    while not context.join(timeout=2):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail("the two gloo processes did not finish in 120 s")
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]

    real = [float(v) for v in values[mask]]
    m, v = statistics.mean(real), statistics.variance(real)
    everything = [float(x) for x in values.flatten()]
    m_all, v_all = statistics.mean(everything), statistics.variance(everything)
    for res in results:
        assert res["sum"].item() == 3.0  # 1 + 2: all_reduce_sum really went through torch.distributed
        assert res["mean_masked"].item() == pytest.approx(m, rel=1e-12)
        assert res["var_masked"].item() == pytest.approx(v, rel=1e-12)
        assert res["mean_all"].item() == pytest.approx(m_all, rel=1e-12)
        assert res["var_all"].item() == pytest.approx(v_all, rel=1e-12)
    # the halves' whitened values equal the unsplit batch's
    whitened = torch.cat([res["whiten_masked"] for res in results])
    kept = torch.cat([res["whiten_masked_keep_mean"] for res in results])
    ref = (values[mask] - m) / math.sqrt(v + 1e-8)
    assert_close(whitened[mask], ref)
    assert_close(kept[mask], ref + m)
    assert_close(torch.cat([res["whiten_all"] for res in results]), (values - m_all) / math.sqrt(v_all + 1e-8))


# ----------------------------------------------------------------------------------------------------------------
# 6. logprobs_from_logits


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_from_logits(dtype, temperature):
    g = torch.Generator().manual_seed(9)
    logits = (torch.randn(3, 4, 11, generator=g) * 4).to(dtype)
    tokens = torch.randint(0, 11, (3, 4), generator=g)
    logprobs, entropy = rloo.logprobs_from_logits(logits, tokens, temperature, with_entropy=True)
    assert logprobs.dtype == torch.float32 and logprobs.shape == (3, 4)
    ref_all = torch.log_softmax(logits.float() / temperature, dim=-1)  # from the bf16 values, cast to float32
    assert_close(logprobs, ref_all.gather(-1, tokens[..., None]).squeeze(-1))
    p = ref_all.exp()
    assert_close(entropy, -(p * ref_all).sum(-1))
    none_logprobs, none_entropy = rloo.logprobs_from_logits(logits, tokens, temperature)
    assert none_entropy is None
    assert_close(none_logprobs, logprobs, rtol=0, atol=0)


def test_logprobs_from_logits_gradient():
    # d/dz sum_t log softmax(z_t / tau)[y_t] = (onehot(y_t) - softmax(z_t / tau)) / tau
    g = torch.Generator().manual_seed(10)
    tau = 0.7
    logits = torch.randn(2, 3, 5, generator=g, dtype=torch.float32).requires_grad_()
    tokens = torch.randint(0, 5, (2, 3), generator=g)
    logprobs, _ = rloo.logprobs_from_logits(logits, tokens, tau)
    logprobs.sum().backward()
    expected = (torch.nn.functional.one_hot(tokens, 5).float() - torch.softmax(logits.detach() / tau, -1)) / tau
    assert_close(logits.grad, expected)


# ----------------------------------------------------------------------------------------------------------------
# 7. reward models: get_reward (decoders), reward_model_values (encoders), render_for_reward


def char_tokenizer(bos=None, eos="<|endoftext|>", pad="<|pad|>", chat_template=None):
    """The toy's character vocabulary with other conventions: a BOS added to every text by a post-processor (as
    Llama's tokenizer does), pad == eos, a chat template."""
    from tokenizers import Tokenizer, decoders, models, processors
    from transformers import PreTrainedTokenizerFast

    tokens = (
        [chr(c) for c in range(32, 127)] + ["\n"] + list(dict.fromkeys([pad, eos, "<|unk|>"] + ([bos] if bos else [])))
    )
    inner = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=[], unk_token="<|unk|>"))
    inner.decoder = decoders.Fuse()
    if bos:
        inner.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", special_tokens=[(bos, tokens.index(bos))]
        )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=inner, bos_token=bos, eos_token=eos, pad_token=pad, unk_token="<|unk|>", padding_side="left"
    )
    tokenizer.chat_template = chat_template
    return tokenizer


def bert_reward_model(seed=3):
    """A tiny BERT sequence classifier and its WordPiece tokenizer, which adds [CLS] ... [SEP]."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import BertConfig, BertForSequenceClassification, PreTrainedTokenizerFast

    characters = [chr(c) for c in range(33, 127)]
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]"] + characters + ["##" + c for c in characters]
    inner = Tokenizer(models.WordPiece({t: i for i, t in enumerate(vocab)}, unk_token="[UNK]"))
    inner.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    inner.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 2), ("[SEP]", 3)]
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=inner, pad_token="[PAD]", unk_token="[UNK]", cls_token="[CLS]", sep_token="[SEP]"
    )
    torch.manual_seed(seed)
    config = BertConfig(
        vocab_size=len(vocab),
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=256,
        num_labels=1,
    )
    return BertForSequenceClassification(config).eval(), tokenizer


@pytest.fixture(scope="module", params=["gpt_neox", "gpt2"])
def tiny_reward_model(request):
    """(model, backbone): the GPT-NeoX of the brief, and a GPT-2, whose learned absolute position embeddings make
    wrong position ids show (GPT-NeoX's rotary embeddings are relative: a left-pad offset cancels out)."""
    from transformers import GPT2Config, GPT2ForSequenceClassification, GPTNeoXConfig, GPTNeoXForSequenceClassification

    torch.manual_seed(0)
    if request.param == "gpt_neox":
        config = GPTNeoXConfig(
            vocab_size=50,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=64,
            max_position_embeddings=64,
            num_labels=1,
            pad_token_id=0,
            eos_token_id=1,
            bos_token_id=1,
        )
        model = GPTNeoXForSequenceClassification(config).eval()
        return model, model.gpt_neox
    config = GPT2Config(
        vocab_size=50,
        n_embd=32,
        n_layer=2,
        n_head=4,
        n_positions=64,
        num_labels=1,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=1,
    )
    model = GPT2ForSequenceClassification(config).eval()
    return model, model.transformer


def test_get_reward(tiny_reward_model):
    model, backbone = tiny_reward_model
    # left-padded prompts + right-padded responses; last_index is each row's last real token
    ids = torch.tensor([[0, 0, 5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 15, 16, 0, 0], [0, 0, 0, 20, 21, 22, 23, 0]])
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 0, 0], [0, 0, 0, 1, 1, 1, 1, 0]])
    last_index = torch.tensor([7, 5, 6])
    with torch.no_grad():
        got = rloo.get_reward(model, ids, mask, last_index)
        assert got.shape == (3,) and got.dtype == torch.float32
        # the score head on the backbone's hidden state at last_index, with positions counting real tokens
        position_ids = (mask.cumsum(1) - 1).clamp(min=0)
        hidden = backbone(input_ids=ids, attention_mask=mask, position_ids=position_ids).last_hidden_state
        ref = torch.stack([model.score(hidden[n, last_index[n]]).squeeze(-1) for n in range(3)])
        assert_close(got, ref)
        # the same as each row alone, without any padding
        alone = []
        for n in range(3):
            real = ids[n][mask[n].bool()][None]
            h = backbone(input_ids=real, position_ids=torch.arange(real.shape[1])[None]).last_hidden_state
            alone.append(model.score(h[0, -1]).squeeze(-1))
        assert_close(got, torch.stack(alone), rtol=1e-5, atol=1e-5)
        # what follows last_index does not matter (other tokens, even unmasked), nor the left-pad token ids
        after = torch.arange(8)[None, :] > last_index[:, None]
        other = rloo.get_reward(model, torch.where(after, 42, ids), torch.where(after, 1, mask), last_index)
        assert_close(other, got)
        left_pad = mask.cumsum(1) == 0
        repadded = rloo.get_reward(model, torch.where(left_pad, 33, ids), mask, last_index)
        assert_close(repadded, got)
        # and the value does depend on the tokens up to last_index (the test would notice a wrong position)
        changed = ids.clone()
        changed[:, 3] = 44
        assert not torch.allclose(rloo.get_reward(model, changed, mask, last_index), got)


def test_encoder_reward_model_scores_each_text_as_alone():
    model, tokenizer = bert_reward_model()
    texts = ["Describe the sea: waves", "a cat!", "Tell me of rain: it falls and falls again"]
    encoded = [rloo.render_for_reward(tokenizer, text, "", stopped=True) for text in texts]
    assert all(ids[0] == tokenizer.cls_token_id and ids[-1] == tokenizer.sep_token_id for ids in encoded)
    ids, mask = rloo.pad_batch(encoded, tokenizer.pad_token_id, left=False)  # an encoder counts positions from 0
    source = rloo.RewardSource("reward_model", "--reward-model-path x", model=model, decoder=False)
    with torch.no_grad():
        got = rloo.reward_model_values(source, model, ids, mask, None)
        alone = torch.stack([model(input_ids=torch.tensor([row])).logits[0, 0] for row in encoded])
    assert got.shape == (3,)
    assert_close(got, alone, rtol=1e-5, atol=1e-5)


def test_render_for_reward_uses_the_reward_tokenizers_conventions():
    llama = char_tokenizer(bos="<s>", eos="</s>", pad="</s>")
    bos, eos = llama.bos_token_id, llama.eos_token_id
    body = llama("Say hi: hello", add_special_tokens=False)["input_ids"]
    # its BOS, the text, and its eos only after a completion that stopped
    assert rloo.render_for_reward(llama, "Say hi:", " hello", stopped=True) == [bos] + body + [eos]
    assert rloo.render_for_reward(llama, "Say hi:", " hello", stopped=False) == [bos] + body
    # an encoder's [CLS] ... [SEP]; it has no eos to add
    _, bert = bert_reward_model()
    encoded = rloo.render_for_reward(bert, "Say hi:", " hello", stopped=True)
    assert encoded == bert("Say hi: hello")["input_ids"] and encoded[0] == bert.cls_token_id
    # chat prompts: its own template, with the completion as the assistant's turn
    chat = char_tokenizer(chat_template="{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}")
    messages = [{"role": "user", "content": "hi"}]
    expected = chat("[user] hi\n[assistant] yo\n", add_special_tokens=False)["input_ids"]
    assert rloo.render_for_reward(chat, messages, "yo", stopped=True) == expected


# ----------------------------------------------------------------------------------------------------------------
# 8. the toy task


def test_toy_tokenizer_is_printable_and_round_trips():
    tokenizer = rloo.toy_tokenizer()
    assert len(tokenizer) == 99  # 95 printable ASCII characters, newline, pad, eos, unk
    special = {tokenizer.pad_token_id, tokenizer.eos_token_id, tokenizer.unk_token_id}
    assert len(special) == 3 and special == {96, 97, 98}
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 99, (500,), generator=g).tolist()
    text = tokenizer.decode(ids, skip_special_tokens=True)
    assert text == "".join(tokenizer.convert_ids_to_tokens(i) for i in ids if i not in special)
    assert all(c.isprintable() or c == "\n" for c in text)
    assert tokenizer(text)["input_ids"] == [i for i in ids if i not in special]  # one token per character, back
    assert tokenizer("é")["input_ids"] == [tokenizer.unk_token_id]  # what it cannot write is unk, never dropped


def test_toy_reward_by_hand():
    completions = ["aei", "xyz", "AEIOU", "a e i o u", "", "banana", "ouch!"]
    got = rloo.toy_reward(["p"] * len(completions), completions, response_length=10)
    assert got == pytest.approx([3.0, 0.0, 0.0, 5.0, 0.0, 3.0, 2.0])
    assert rloo.toy_reward(["p"], ["aaaa"]) == pytest.approx([10.0 * 4 / 53])  # default length: 53


# ----------------------------------------------------------------------------------------------------------------
# 9. flags: validate_args (the flags alone), resolve_args (with the tokenizer and the prompts), the command line


def run_main(tmp_path, **fields):
    """rloo.main in this process, for the checks that fire before any model is loaded or trained."""
    fields.setdefault("output_dir", str(tmp_path / "out"))
    with pytest.raises(SystemExit) as error:
        rloo.main(rloo.Args(**fields))
    return str(error.value.code)


@pytest.mark.parametrize(
    "fields, flag",
    [
        (dict(rloo_k=1), "--rloo-k"),
        (dict(per_device_train_batch_size=6, rloo_k=4), "--rloo-k"),
        (dict(per_device_train_batch_size=6, rloo_k=4), "--per-device-train-batch-size"),
        (dict(response_length=0), "--response-length"),
        (dict(temperature=0.0), "--temperature"),
        (dict(temperature=math.nan), "--temperature"),
        (dict(cliprange=0.0), "--cliprange"),
        (dict(kl_coef=-0.1), "--kl-coef"),
        (dict(reward_clip_range=0.0), "--reward-clip-range"),
        (dict(learning_rate=0.0), "--learning-rate"),
        (dict(total_episodes=4), "--total-episodes"),
        (dict(total_episodes=0), "--total-episodes"),
        (dict(num_mini_batches=0), "--num-mini-batches"),
        (dict(missing_eos_penalty=1.0), "--missing-eos-penalty"),
        (dict(max_grad_norm=-1.0), "--max-grad-norm"),
        (dict(save_total_limit=-1), "--save-total-limit"),
        (dict(save_total_limit=0), "--save-total-limit"),
        (dict(num_train_epochs=0.0), "--num-train-epochs"),
        (dict(num_train_epochs=-2.0), "--num-train-epochs"),
        (dict(stop_token_id=99), "--stop-token-id"),  # the toy vocabulary has 99 tokens: 0..98
        (dict(stop_token_id=-1), "--stop-token-id"),
        (dict(seed=2**32), "--seed"),
        (dict(seed=-1), "--seed"),
        (dict(reward_weights=[1.0, 2.0]), "--reward-weights"),  # the toy has one reward source
        (dict(reward_weights=[math.inf]), "--reward-weights"),
        (dict(max_prompt_length=0), "--max-prompt-length"),
        (dict(num_sample_generations=-1), "--num-sample-generations"),
        (dict(kl_coef=math.inf), "--kl-coef"),
        (dict(eval_temperature=math.inf), "--eval-temperature"),
        (dict(missing_eos_penalty=math.nan, stop_token="eos"), "--missing-eos-penalty"),
        (dict(missing_eos_penalty=-1.0, stop_token="eos"), "--missing-eos-penalty"),
    ],
)
def test_flag_checks(tmp_path, fields, flag):
    message = run_main(tmp_path, **fields)
    assert flag in message and "\n" not in message
    assert not (tmp_path / "out").exists()  # nothing was written


@slow
def test_bad_flag_exits_with_one_line_and_no_traceback(tmp_path):
    proc = subprocess.run(
        [sys.executable, RLOO_PY, "--rloo-k", "1", "--output-dir", str(tmp_path / "o")],
        capture_output=True,
        text=True,
        env=subprocess_env(),
        timeout=120,
    )
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "--rloo-k" in lines[0], proc.stderr


def check_flags(world_size=1, num_prompts=256, **changes):
    args = dataclasses.replace(rloo.Args(), **changes)
    rloo.validate_args(args)
    return rloo.resolve_args(args, world_size, rloo.toy_tokenizer(), num_prompts)


def test_resolve_args_total_episodes_counts_every_process():
    check_flags(world_size=2, total_episodes=16)  # one update on 2 processes is 8 x 2 = 16
    with pytest.raises(rloo.ArgumentError, match="--total-episodes"):
        check_flags(world_size=3, total_episodes=16)


def test_resolve_args_derives_sizes_once():
    args = check_flags(
        world_size=2,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=3,
        num_mini_batches=2,
        rloo_k=3,
        num_train_epochs=2.0,
        num_prompts=100,
    )
    assert (args.local_batch_size, args.batch_size) == (24, 48)
    assert args.local_dataloader_batch_size == 8  # prompts per process: 24 completions / k=3
    assert args.total_episodes == 200 and args.num_total_batches == math.ceil(200 / 48)
    assert args.learning_rate == 1e-3 and args.output_dir == os.path.join("runs", args.run_name)
    assert check_flags(stop_token="eos").stop_token_id == rloo.toy_tokenizer().eos_token_id


def test_flag_checks_accept_defaults_and_valid_combinations():
    check_flags()
    check_flags(world_size=8, num_prompts=1000)
    check_flags(missing_eos_penalty=1.0, stop_token="eos")
    check_flags(missing_eos_penalty=1.0, stop_token_id=3)
    check_flags(per_device_train_batch_size=6, rloo_k=3, kl_coef=0.0, max_grad_norm=0.0)
    check_flags(seed=2**32 - 1)


def test_cli_parses_flags():
    assert tyro.cli(rloo.Args, args=["--rloo-k", "4"]).rloo_k == 4
    assert tyro.cli(rloo.Args, args=["--token-level-kl"]).token_level_kl is True
    assert tyro.cli(rloo.Args, args=["--no-token-level-kl"]).token_level_kl is False
    args = tyro.cli(rloo.Args, args=["--stop-token", "eos", "--missing-eos-penalty", "1.5", "--kl-coef", "0.1"])
    assert (args.stop_token, args.missing_eos_penalty, args.kl_coef) == ("eos", 1.5, 0.1)
    args = tyro.cli(rloo.Args, args=["--reward-fn", "a:b", "c:d", "--reward-weights", "1", "0.5"])
    assert (args.reward_fn, args.reward_weights) == (["a:b", "c:d"], [1.0, 0.5])


TRL_FLAGS = (
    # RLOOConfig
    "--exp-name --reward-model-path --num-ppo-epochs --whiten-rewards --kl-coef --cliprange --rloo-k "
    "--normalize-reward --reward-clip-range --normalize-advantage --token-level-kl --ds3-gather-for-generation "
    # OnPolicyConfig
    "--run-name --sft-model-path --total-episodes --num-mini-batches --local-rollout-forward-batch-size "
    "--num-sample-generations --response-length --stop-token --stop-token-id --temperature --missing-eos-penalty"
).split()


@slow
def test_cli_help_lists_trl_flags_and_each_default_once():
    result = subprocess.run(
        [sys.executable, RLOO_PY, "--help"], capture_output=True, text=True, cwd=ROOT, env=subprocess_env(), timeout=120
    )
    assert result.returncode == 0, result.stderr
    missing = [f for f in TRL_FLAGS if not re.search(rf"(?<![\w-]){re.escape(f)}(?![\w-])", result.stdout)]
    assert not missing, missing
    assert "(default: (default" not in result.stdout and result.stdout.count("(default:") == len(
        [f for f in dataclasses.fields(rloo.Args) if f.name not in DERIVED]
    )
    assert "--batch-size" not in result.stdout  # the derived sizes are not flags


DERIVED = (
    "world_size",
    "local_batch_size",
    "batch_size",
    "local_dataloader_batch_size",
    "num_total_batches",
)


def test_defaults_equal_trl():
    args = rloo.Args()
    trl = dict(
        num_ppo_epochs=4,
        whiten_rewards=False,
        kl_coef=0.05,
        cliprange=0.2,
        rloo_k=2,
        normalize_reward=False,
        reward_clip_range=10.0,
        normalize_advantage=False,
        token_level_kl=False,
        ds3_gather_for_generation=True,
        num_mini_batches=1,
        local_rollout_forward_batch_size=64,
        num_sample_generations=10,
        response_length=53,
        stop_token=None,
        temperature=0.7,
        missing_eos_penalty=None,
    )
    assert {name: getattr(args, name) for name in trl} == trl
    assert args.exp_name == "rloo"  # TRL: the script's name without .py


# ----------------------------------------------------------------------------------------------------------------
# 10. prompts: load_prompts


def prompts_of(tmp_path, lines, tokenizer=None, **fields):
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join(lines) + "\n")
    args = rloo.Args(dataset_name=str(path), **fields)
    return rloo.load_prompts(args, tokenizer or rloo.toy_tokenizer(), str(path), "train", "--dataset-name")


@pytest.mark.parametrize(
    "lines, words",
    [
        (['{"prompt": null}'], ["line 1", "'prompt'", "null"]),
        (['{"prompt": "a"}', '{"prompt": 5}'], ["line 2", "a number"]),
        (['{"prompt": "a"}', '{"prompt": {"text": "b"}}'], ["line 2", "a JSON object"]),
        (['{"prompt": "a"}', '{"text": "b"}'], ["--dataset-text-field", "line 2", "text"]),
        (['{"prompt": "a"}', "null"], ["line 2", "null", "not a JSON object"]),
        (['{"prompt": "a"}', "7"], ["line 2", "a number", "not a JSON object"]),
        (['[{"prompt": "a"}]'], ["line 1", "a JSON array"]),
        (['{"prompt": "\\ud800 x"}'], ["line 1", "lone surrogate"]),
        (['{"prompt": [{"role": "user", "content": 3}]}'], ["line 1", "content"]),
        (['{"prompt": "a"}'] * 100 + ['{"prompt": "b"'], ["line 101", "not valid JSON"]),
        (['{"prompt": "a"}', "", '{"prompt": '], ["line 3", "not valid JSON"]),
    ],
)
def test_bad_data_is_one_line_naming_the_line(tmp_path, lines, words):
    with pytest.raises(rloo.ArgumentError) as error:
        prompts_of(tmp_path, lines)
    message = str(error.value.code)
    assert "\n" not in message and ("data.jsonl" in message or "--dataset-text-field" in message)
    for word in words:
        assert word in message, message


def test_prompts_keep_the_tokenizers_bos_and_every_column(tmp_path):
    tokenizer = char_tokenizer(bos="<s>", eos="</s>", pad="</s>")
    prompts, rows, dropped = prompts_of(
        tmp_path, ['{"prompt": "Hi:", "answer": 3}', '{"prompt": "' + "x" * 40 + '"}'], tokenizer, max_prompt_length=10
    )
    assert prompts == [[tokenizer.bos_token_id] + tokenizer("Hi:", add_special_tokens=False)["input_ids"]]
    assert rows == [{"prompt": "Hi:", "answer": 3}] and dropped == 1


def test_dataset_directories_keep_every_column(tmp_path):
    import datasets

    rows = [{"prompt": f"Add {n} and 1:", "answer": n + 1, "tag": f"t{n}"} for n in range(3)]
    datasets.Dataset.from_list(rows).save_to_disk(tmp_path / "one")  # a Dataset: no splits
    splits = {"train": datasets.Dataset.from_list(rows[:1]), "test": datasets.Dataset.from_list(rows[1:])}
    datasets.DatasetDict(splits).save_to_disk(tmp_path / "two")
    tokenizer = rloo.toy_tokenizer()
    for path, split, expected in [("one", "train", rows), ("two", "test", rows[1:]), ("two", "train", rows[:1])]:
        prompts, got, _ = rloo.load_prompts(rloo.Args(), tokenizer, str(tmp_path / path), split, "--dataset-name")
        assert got == expected  # every column, in order, for the reward functions' keyword arguments
        assert prompts == [tokenizer(row["prompt"])["input_ids"] for row in expected]


def test_chat_prompts_use_the_chat_template(tmp_path):
    template = "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
    tokenizer = char_tokenizer(bos="<s>", eos="</s>", pad="</s>", chat_template=template)
    lines = [
        json.dumps({"messages": [{"role": "user", "content": "hi there"}]}),
        json.dumps({"messages": [{"role": "user", "content": "x" * 300}]}),
    ]
    prompts, rows, dropped = prompts_of(
        tmp_path, lines, tokenizer, dataset_text_field="messages", max_prompt_length=100
    )
    # the template rendered by hand: its own BOS, once; the 300-character prompt is over max_prompt_length
    expected = tokenizer("user: hi there\nassistant:", add_special_tokens=False)["input_ids"]
    assert prompts == [[tokenizer.bos_token_id] + expected] and dropped == 1
    assert rows == [json.loads(lines[0])]


def test_chat_prompts_without_a_usable_template_are_one_line(tmp_path):
    lines = [json.dumps({"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]})]
    with pytest.raises(rloo.ArgumentError, match="--dataset-text-field.*no chat template"):
        prompts_of(tmp_path, lines)  # the toy tokenizer has no chat template
    refusing = char_tokenizer(
        chat_template=(
            "{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
            "{% endif %}{{ m['content'] }}{% endfor %}"
        )
    )
    with pytest.raises(rloo.ArgumentError) as error:
        prompts_of(tmp_path, lines, refusing)
    message = str(error.value.code)
    assert "--dataset-text-field" in message and "System role not supported" in message and "line 1" in message


def test_prompts_left_out_for_length_are_counted(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join(json.dumps({"prompt": "y" * (5 if n == 0 else 80)}) for n in range(256)) + "\n")
    message = run_main(tmp_path, dataset_name=str(path), max_prompt_length=50)
    assert "255" in message and "--max-prompt-length 50" in message and "1 prompts" in message


# ----------------------------------------------------------------------------------------------------------------
# 11. reward functions: the columns they are given, and their checks at start-up


def test_reward_functions_get_the_columns_they_name():
    seen = {}

    def named(prompts, completions, answer):
        seen["named"] = answer
        return [1.0] * len(completions)

    def everything(prompts, completions, **kwargs):
        seen["everything"] = kwargs
        return [2.0] * len(completions)

    def old_style(p, c):
        return [3.0] * len(c)

    columns = {"answer": [4, 5], "source": ["x", "y"]}
    for fn, value in [(named, 1.0), (everything, 2.0), (old_style, 3.0)]:
        source = rloo.RewardSource(fn.__name__, f"--reward-fn m:{fn.__name__}", fn=fn)
        assert rloo.call_reward_fn(source, ["p", "q"], ["a", "b"], columns) == [value, value]
    assert seen == {"named": [4, 5], "everything": columns}


@pytest.mark.parametrize(
    "function, words",
    [
        ("no_module_here:fn", "cannot import"),
        ("test_rewards:missing", "cannot import"),
        ("test_rewards:wrong_count", "numbers"),
        ("test_rewards:not_numbers", "not a number"),
        ("test_rewards:always_nan", "NaN"),
    ],
)
def test_reward_fn_validation(workdir, tmp_path, monkeypatch, function, words):
    monkeypatch.chdir(workdir)
    message = run_main(tmp_path, reward_fn=[function])
    assert "--reward-fn" in message and words in message


def test_reward_functions_are_checked_against_every_dataset(workdir, tmp_path, monkeypatch):
    monkeypatch.chdir(workdir)
    # two sources may not share a name: their rewards and metrics go by it
    message = run_main(tmp_path, reward_fn=["test_rewards:vowels", "test_rewards:vowels"])
    assert "--reward-fn" in message and "share a name" in message
    # the evaluation prompts lack the column the function needs: found at start-up, not at the first evaluation
    train, held_out = tmp_path / "train.jsonl", tmp_path / "held_out.jsonl"
    train.write_text("".join(json.dumps({"prompt": f"p{n}:", "answer": n}) + "\n" for n in range(8)))
    held_out.write_text(json.dumps({"prompt": "q:"}) + "\n")
    message = run_main(
        tmp_path,
        dataset_name=str(train),
        reward_fn=["test_rewards:columns"],
        eval_steps=1,
        eval_dataset_name=str(held_out),
    )
    assert "--reward-fn test_rewards:columns raised TypeError" in message and "\n" not in message


# ----------------------------------------------------------------------------------------------------------------
# 12. `import rloo` runs nothing


@slow
def test_import_runs_nothing(tmp_path):
    cwd, report = tmp_path / "cwd", tmp_path / "modules.txt"
    cwd.mkdir()
    code = (
        "import sys, rloo; open(sys.argv[1], 'w').write(repr((rloo.__file__, sorted(m for m in "
        "('accelerate', 'deepspeed', 'transformers', 'datasets', 'peft') if m in sys.modules))))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code, str(report)],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=subprocess_env(),
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == "" and result.stderr == ""  # prints nothing
    assert os.listdir(cwd) == []  # writes nothing: no runs/, no metrics, no checkpoint
    path, heavy = eval(report.read_text())
    assert os.path.samefile(path, RLOO_PY)
    assert heavy == []  # the heavy libraries load in main(), not on import


# ----------------------------------------------------------------------------------------------------------------
# end to end: rloo.py in a subprocess (one process: plain `python rloo.py`; otherwise, and for the README's main
# command, `accelerate launch`), offline, with tiny local models

METRIC_NAMES = [
    "objective/kl",
    "objective/entropy",
    "objective/non_score_reward",
    "objective/rlhf_reward",
    "objective/scores",
    "policy/approxkl_avg",
    "policy/clipfrac_avg",
    "loss/policy_avg",
    "policy/entropy_avg",
    "val/ratio",
    "val/ratio_var",
    "val/num_eos_tokens",
    "lr",
    "episode",
    "eps",
    "train/skipped_steps",
    "frac_reward_zero_std",
    "time/generation",
    "time/scoring",
    "time/training",
    "time/other",
    "time/tokens_per_second",
    "time/peak_memory_mib",
]
# a short run: 4 updates of 8 completions, 8 tokens each
SHORT = [
    "--response-length",
    "8",
    "--total-episodes",
    "32",
    "--per-device-train-batch-size",
    "8",
    "--num-sample-generations",
    "0",
    "--local-rollout-forward-batch-size",
    "8",
]
CHAT_TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"

REWARD_MODULE = '''
import json, os, signal, sys, time
calls = {}

def log(name, prompts, completions, scores, **columns):
    """Record every call of a reward function, the start-up check included; returns the scores."""
    calls[name] = calls.get(name, 0) + 1
    if os.environ.get("RLOO_TEST_LOG"):
        with open(f"{os.environ['RLOO_TEST_LOG']}.{name}.{os.environ.get('RANK', '0')}", "a") as f:
            f.write(json.dumps({"prompts": prompts, "completions": completions, "scores": scores, **columns}) + "\\n")
    return scores

def vowels(prompts, completions):
    """Lowercase vowels per completion; RLOO_TEST_* variables make it preempt its process or turn to NaN."""
    call = calls.get("vowels", 0) + 1  # call 1 is rloo.py's start-up check
    scores = [float(sum(c in "aeiou" for c in text)) for text in completions]
    if os.environ.get("RLOO_TEST_NAN_FROM") and call >= int(os.environ["RLOO_TEST_NAN_FROM"]):
        scores = [float(os.environ.get("RLOO_TEST_NAN_VALUE", "nan"))] * len(completions)
    if os.environ.get("RLOO_TEST_KILL_AT") and call == int(os.environ["RLOO_TEST_KILL_AT"]):
        if os.environ.get("RANK", "0") == "0":  # like a scheduler's preemption, seen first by one rank
            os.kill(os.getpid(), signal.SIGTERM)
    if os.environ.get("RLOO_TEST_RAISE_AT") and call == int(os.environ["RLOO_TEST_RAISE_AT"]):
        raise ValueError("the grader is down")
    if os.environ.get("RLOO_TEST_EXIT_AT") and call == int(os.environ["RLOO_TEST_EXIT_AT"]):
        sys.exit(0)
    if os.environ.get("RLOO_TEST_SLEEP"):  # a slow reward, for signals sent mid-update
        with open(os.environ["RLOO_TEST_SLEEP"] + ".calls", "a") as f:
            f.write(".")
        time.sleep(1.0)
    return log("vowels", prompts, completions, scores)

def columns(prompts, completions, answer, **kwargs):
    """A verifiable reward: the dataset's `answer` column (computable from the prompt) modulo 5."""
    return log("columns", prompts, completions, [float(a % 5) for a in answer], answer=answer, **kwargs)

def constant(prompts, completions):
    return [1.0] * len(completions)

def distinct(prompts, completions):
    """A different value for every completion of a call."""
    return log("distinct", prompts, completions, [i + 0.01 * len(text) for i, text in enumerate(completions)])

def huge(prompts, completions):
    return [100.0] * len(completions)

def wrong_count(prompts, completions):
    return [1.0]

def not_numbers(prompts, completions):
    return ["high"] * len(completions)

def always_nan(prompts, completions):
    return [float("nan")] * len(completions)
'''


def eos_likely(policy, tokenizer, p=0.2, temperature=0.7):
    """Sample eos with probability about p at `temperature` whatever the input, and never pad or unk: unit 0 of
    the final layer norm outputs a constant 1, whose output column adds a fixed logit to eos (the other logits still
    depend on the input, and are near 0 at initialization)."""
    with torch.no_grad():
        norm, head = policy.gpt_neox.final_layer_norm, policy.get_output_embeddings()
        norm.weight[0], norm.bias[0] = 0.0, 1.0
        head.weight[:, 0] = 0.0
        printable = len(tokenizer) - 3  # pad, eos, unk come last in the toy vocabulary
        head.weight[tokenizer.eos_token_id, 0] = temperature * math.log(p * printable / (1 - p))
        head.weight[[tokenizer.pad_token_id, tokenizer.unk_token_id], 0] = -1e4
    return policy


@pytest.fixture(scope="session")
def workdir(tmp_path_factory):
    """Tiny local models and data in one temporary directory: the toy policy (also with a chat template, and in an
    eos-likely variant), GPT-NeoX reward models (the policy's tokenizer, another tokenizer, two labels), a BERT
    reward model, a Llama policy saved in bf16 whose tokenizer adds BOS, the reward functions, a chat dataset."""
    from transformers import GPTNeoXForSequenceClassification, LlamaConfig, LlamaForCausalLM

    root = tmp_path_factory.mktemp("rloo")
    tokenizer = rloo.toy_tokenizer()
    policy = rloo.toy_policy(tokenizer, seed=0)
    for name, chat_template in [("policy", None), ("policy_chat", CHAT_TEMPLATE)]:
        policy.save_pretrained(root / name)
        tokenizer.chat_template = chat_template
        tokenizer.save_pretrained(root / name)
    tokenizer.chat_template = None
    eos_likely(copy.deepcopy(policy), tokenizer).save_pretrained(root / "policy_eos")
    tokenizer.save_pretrained(root / "policy_eos")
    config = copy.deepcopy(policy.config)
    config.num_labels = 1
    torch.manual_seed(1)
    reward = GPTNeoXForSequenceClassification(config)
    reward.save_pretrained(root / "reward")
    tokenizer.save_pretrained(root / "reward")
    # the same model, with a tokenizer that has one more special token: rloo.py must re-encode for it
    reward.save_pretrained(root / "reward_other_tokenizer")
    other = rloo.toy_tokenizer()
    other.add_special_tokens({"additional_special_tokens": ["<|sep|>"]})
    other.save_pretrained(root / "reward_other_tokenizer")
    config.num_labels = 2
    GPTNeoXForSequenceClassification(config).save_pretrained(root / "reward_two_labels")
    bert, bert_tokenizer = bert_reward_model()
    bert.save_pretrained(root / "reward_bert")
    bert_tokenizer.save_pretrained(root / "reward_bert")
    llama_tokenizer = char_tokenizer(bos="<s>", eos="</s>", pad="</s>")
    torch.manual_seed(2)
    llama = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=len(llama_tokenizer),
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=128,
            bos_token_id=llama_tokenizer.bos_token_id,
            eos_token_id=llama_tokenizer.eos_token_id,
            pad_token_id=llama_tokenizer.pad_token_id,
        )
    )
    llama.to(torch.bfloat16).save_pretrained(root / "llama_bf16")
    llama_tokenizer.save_pretrained(root / "llama_bf16")
    (root / "test_rewards.py").write_text(REWARD_MODULE)
    subjects = ["the sea", "a cat", "the moon", "old trees", "rain", "a city", "bread", "the wind"]
    rows = [
        {"messages": [{"role": "user", "content": f"Describe {s}"}], "answer": len(f"Describe {s}"), "tag": f"t{n}"}
        for n, s in enumerate(subjects)
    ]
    (root / "chat.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    return root


def launch(workdir, output, *flags, backend="single", env=None, check=True, pythonpath=None, preexec_fn=None):
    """rloo.py in a subprocess: one process without a launcher (`python rloo.py`, which the docstring documents;
    the launcher's own start costs about 4 s), or under `accelerate launch`: one process ("accelerate"), two under
    ZeRO-3 (ds_zero3.yaml), DDP, or `--multi_gpu` alone, without ACCELERATE_USE_CPU (rloo.py must make it DDP)."""
    command = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--num_machines",
        "1",
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
    ]
    run_env = subprocess_env(pythonpath=pythonpath or workdir, **(env or {}))
    if backend == "single":
        command = [sys.executable]
    elif backend == "zero3":
        command += ["--config_file", str(ROOT / "ds_zero3.yaml"), "--num_processes", "2"]
    elif backend in ("ddp", "multi_gpu"):
        command += ["--multi_gpu", "--num_processes", "2"]
        if backend == "ddp":
            run_env["ACCELERATE_USE_CPU"] = "true"
        else:
            run_env.pop("ACCELERATE_USE_CPU", None)
    else:
        command += ["--num_processes", "1"]  # "accelerate"
    command += [RLOO_PY, "--output-dir", str(output), *flags]
    proc = subprocess.run(
        command, cwd=workdir, env=run_env, capture_output=True, text=True, timeout=900, preexec_fn=preexec_fn
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"rloo.py failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return proc


def read_metrics(output, kind="train"):
    """metrics.jsonl's records: "all", the updates' ("train", which have an episode), or the evaluations' ("eval")."""
    records = [json.loads(line) for line in (pathlib.Path(output) / "metrics.jsonl").read_text().splitlines()]
    return [m for m in records if kind == "all" or ("episode" in m) == (kind == "train")]


def read_calls(log, name, rank=0):
    """The logged calls of a reward function during training: the first call, rloo.py's start-up check, is left out."""
    lines = pathlib.Path(f"{log}.{name}.{rank}").read_text().splitlines()
    return [json.loads(line) for line in lines[1:]]


def load_weights(directory):
    from safetensors.torch import load_file

    return load_file(str(pathlib.Path(directory) / "model.safetensors"))


# ----------------------------------------------------------------------------------------------------------------
# 13. end to end on one process


@slow
def test_toy_run_writes_every_metric(workdir, tmp_path):
    # the README's main command: under `accelerate launch`
    flags = ["--rloo-k", "4", *SHORT[:-4], "--num-sample-generations", "2"]
    proc = launch(workdir, tmp_path / "out", *flags, backend="accelerate")
    metrics = read_metrics(tmp_path / "out")
    assert [m["update"] for m in metrics] == [1, 2, 3, 4]
    assert [m["episode"] for m in metrics] == [8, 16, 24, 32]
    for m in metrics:
        assert set(METRIC_NAMES) <= set(m), set(METRIC_NAMES) - set(m)
        assert all(math.isfinite(m[name]) for name in METRIC_NAMES)
        assert m["eps"] > 0
        assert m["rewards/toy_reward"] == m["objective/scores"]  # one source, weight 1, no penalty
    # linear decay from the toy's 1e-3 to 0 over exactly 4 updates
    assert [m["lr"] for m in metrics] == pytest.approx([1e-3, 0.75e-3, 0.5e-3, 0.25e-3])
    assert metrics[0]["objective/kl"] == pytest.approx(0.0, abs=1e-5)  # policy == reference before any step
    assert "done in" in proc.stdout and "first tenth" in proc.stdout and "episodes/s" in proc.stdout
    cores = len(os.sched_getaffinity(0))  # accelerate launch sets OMP_NUM_THREADS=1; rloo.py uses every core
    assert f"1 processes, {cores} CPU threads each" in proc.stdout
    assert proc.stdout.count("| score") == 2  # num_sample_generations tables
    assert (tmp_path / "out" / "model.safetensors").exists()


@slow
def test_local_models_save_a_model_that_reloads(workdir, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    launch(
        workdir,
        tmp_path / "out",
        "--sft-model-path",
        str(workdir / "policy"),
        "--reward-model-path",
        str(workdir / "reward"),
        "--stop-token",
        "eos",
        "--learning-rate",
        "1e-3",
        "--max-grad-norm",
        "0",  # HF's convention: no clipping (it once left the model bitwise at its initialization)
        *SHORT,
    )
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "out")
    initial = AutoModelForCausalLM.from_pretrained(workdir / "policy")
    assert len(tokenizer) == model.config.vocab_size
    changed = [n for n, p in model.state_dict().items() if not torch.equal(p, initial.state_dict()[n])]
    assert changed, "training changed no weight"
    assert all(math.isfinite(m["objective/scores"]) for m in read_metrics(tmp_path / "out"))


@slow
@pytest.mark.parametrize("token_level", [False, True])
def test_first_ratio_is_one_with_one_epoch(workdir, tmp_path, token_level):
    flags = ["--num-ppo-epochs", "1", "--rloo-k", "4", "--reward-fn", "test_rewards:constant"]
    launch(workdir, tmp_path / "out", *flags, *(["--token-level-kl"] if token_level else []), *SHORT)
    metrics = read_metrics(tmp_path / "out")
    assert metrics[0]["val/ratio"] == 1.0
    assert metrics[0]["policy/clipfrac_avg"] == 0.0
    assert metrics[0]["policy/approxkl_avg"] == 0.0
    assert [m["frac_reward_zero_std"] for m in metrics] == [1.0] * 4  # a constant reward: every prompt's k tie


@slow
def test_token_level_kl_changes_the_loss(workdir, tmp_path):
    flags = ["--kl-coef", "0.5", "--num-ppo-epochs", "2", *SHORT]
    launch(workdir, tmp_path / "sequence", *flags)
    launch(workdir, tmp_path / "token", "--token-level-kl", *flags)
    sequence, token = read_metrics(tmp_path / "sequence"), read_metrics(tmp_path / "token")
    # the first rollout is the same (same seed, policy == reference: KL 0, so the advantages agree too)
    assert sequence[0]["objective/scores"] == token[0]["objective/scores"]
    # once the policy has moved, the KL enters each token's advantage instead of the sequence reward
    assert all(m["objective/kl"] != 0 for m in sequence[1:])
    assert any(
        a["loss/policy_avg"] != pytest.approx(b["loss/policy_avg"], abs=1e-6) for a, b in zip(sequence[1:], token[1:])
    )


@slow
def test_reward_fn_scores_the_completions(workdir, tmp_path):
    log = tmp_path / "calls"
    launch(
        workdir,
        tmp_path / "out",
        "--reward-fn",
        "test_rewards:vowels",
        "--rloo-k",
        "4",
        *SHORT,
        "--save-steps",
        "1",
        "--save-total-limit",
        "2",
        env={"RLOO_TEST_LOG": str(log)},
    )
    # a checkpoint after every update, the newest 2 kept
    assert sorted(p.name for p in (tmp_path / "out").glob("checkpoint-*")) == ["checkpoint-3", "checkpoint-4"]
    calls, metrics = read_calls(log, "vowels"), read_metrics(tmp_path / "out")
    assert len(calls) == 4
    for call, m in zip(calls, metrics):
        assert len(call["completions"]) == 8
        # k-major: the 2 prompts of the update, each repeated k = 4 times in the same order
        assert call["prompts"] == call["prompts"][:2] * 4 and call["prompts"][0] in rloo.toy_prompts()
        assert [float(sum(c in "aeiou" for c in text)) for text in call["completions"]] == call["scores"]
        assert m["objective/scores"] == pytest.approx(sum(call["scores"]) / 8)


@slow
def test_missing_eos_penalty_uses_the_stop_token(workdir, tmp_path):
    # the stop token is the character "e", not eos: a completion has it iff its text ends with "e" after truncation
    stop_id = rloo.toy_tokenizer().convert_tokens_to_ids("e")
    log = tmp_path / "calls"
    launch(
        workdir,
        tmp_path / "out",
        "--reward-fn",
        "test_rewards:vowels",
        "--stop-token-id",
        str(stop_id),
        "--missing-eos-penalty",
        "2.5",
        "--response-length",
        "48",
        "--total-episodes",
        "32",
        "--num-sample-generations",
        "0",
        env={"RLOO_TEST_LOG": str(log)},
    )
    calls, metrics = read_calls(log, "vowels"), read_metrics(tmp_path / "out")
    saw_both = set()
    for call, m in zip(calls, metrics):
        for text in call["completions"]:
            assert "e" not in text[:-1]  # truncated after the first stop token, which is kept
            saw_both.add(text.endswith("e"))
        expected = [s - 2.5 * (not text.endswith("e")) for s, text in zip(call["scores"], call["completions"])]
        assert m["objective/scores"] == pytest.approx(sum(expected) / len(expected), abs=1e-5)
    assert saw_both == {True, False}


@slow
@pytest.mark.parametrize("normalize", [False, True])
def test_reward_normalization_and_clipping(workdir, tmp_path, normalize):
    log = tmp_path / "calls"
    flags = ["--reward-fn", "test_rewards:distinct", "--reward-clip-range", "0.5", "--kl-coef", "0.1", *SHORT]
    normalization = ["--normalize-reward"] if normalize else []
    proc = launch(workdir, tmp_path / "out", *flags, *normalization, env={"RLOO_TEST_LOG": str(log)})
    call, first = read_calls(log, "distinct")[0], read_metrics(tmp_path / "out")[0]
    scores = torch.tensor(call["scores"], dtype=torch.float64)
    if normalize:
        scores = (scores - scores.mean()) / (scores.var() + 1e-8).sqrt()  # unbiased variance, over the batch
    clipped = scores.clamp(-0.5, 0.5)  # clipping applies with or without normalization (TRL: only with)
    assert first["objective/scores"] == pytest.approx(sum(call["scores"]) / 8)  # the raw score is logged
    # update 1: policy == reference, so the KL is 0 and the RLHF reward is the clipped score
    assert first["objective/rlhf_reward"] == pytest.approx(clipped.mean().item(), abs=1e-5)
    assert first["frac_reward_zero_std"] == 0.0  # every completion scored differently
    assert first["objective/scores_clipped_frac"] == pytest.approx((scores.abs() >= 0.5).double().mean().item())
    assert proc.stdout.count("of its scores to --reward-clip-range") == 1  # over a tenth: one warning per run


# ----------------------------------------------------------------------------------------------------------------
# 14. reward sources: functions that see the data, weights, reward models with their own tokenizers


@slow
def test_reward_functions_see_columns_and_chat_prompts_and_are_weighted(workdir, tmp_path):
    log = tmp_path / "calls"
    launch(
        workdir,
        tmp_path / "out",
        "--sft-model-path",
        "policy_chat",
        "--dataset-name",
        "chat.jsonl",
        "--dataset-text-field",
        "messages",
        "--reward-fn",
        "test_rewards:columns",
        "test_rewards:vowels",
        "--reward-weights",
        "0.5",
        "2.0",
        *SHORT,
        env={"RLOO_TEST_LOG": str(log)},
    )
    rows = [json.loads(line) for line in (workdir / "chat.jsonl").read_text().splitlines()]
    startup = json.loads((pathlib.Path(f"{log}.columns.0")).read_text().splitlines()[0])
    assert startup["prompts"] == [rows[0]["messages"], rows[1]["messages"]]  # the same form at start-up
    calls, other, metrics = read_calls(log, "columns"), read_calls(log, "vowels"), read_metrics(tmp_path / "out")
    assert len(calls) == len(other) == len(metrics) == 4
    for call, vowel_call, m in zip(calls, other, metrics):
        # chat prompts arrive as their messages; every column arrives aligned with its prompt, k-major
        assert all(isinstance(p, list) and p[0]["role"] == "user" for p in call["prompts"])
        assert call["answer"] == [len(p[0]["content"]) for p in call["prompts"]]
        by_prompt = {json.dumps(row["messages"]): row["tag"] for row in rows}
        assert call["tag"] == [by_prompt[json.dumps(p)] for p in call["prompts"]]  # through **kwargs
        assert vowel_call["completions"] == call["completions"]  # a function without keyword parameters
        assert m["rewards/columns"] == pytest.approx(statistics.mean(call["scores"]))
        assert m["rewards/vowels"] == pytest.approx(statistics.mean(vowel_call["scores"]))
        assert m["objective/scores"] == pytest.approx(0.5 * m["rewards/columns"] + 2.0 * m["rewards/vowels"], abs=1e-5)


def reward_model_scores(model_dir, texts):
    """A reward model's own forward on each text alone: its own tokenizer, no padding."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    model = AutoModelForSequenceClassification.from_pretrained(model_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    with torch.no_grad():
        return [model(input_ids=torch.tensor([tokenizer(text)["input_ids"]])).logits[0, 0].item() for text in texts]


@slow
def test_reward_model_with_another_tokenizer_scores_the_same_tokens(workdir, tmp_path):
    # completions that stop at eos (probability 0.2 per token): a reward model is read at that eos
    log = tmp_path / "calls"
    flags = ["--sft-model-path", "policy_eos", "--stop-token", "eos", *SHORT, "--response-length", "16"]
    launch(workdir, tmp_path / "same", *flags, "--reward-model-path", "reward")
    launch(
        workdir,
        tmp_path / "other",
        *flags,
        "--reward-model-path",
        "reward_other_tokenizer",
        "--reward-fn",
        "test_rewards:vowels",
        "--reward-weights",
        "1",
        "0",
        env={"RLOO_TEST_LOG": str(log)},
    )
    same, other = read_metrics(tmp_path / "same")[0], read_metrics(tmp_path / "other")[0]
    assert 0 < same["val/num_eos_tokens"] < 8  # some completions stopped, some ran to the end
    assert other["objective/scores"] == pytest.approx(same["objective/scores"], rel=1e-5, abs=1e-6)
    # and what it scored is prompt + completion + eos (where the completion stopped), as its own forward reads it
    call = read_calls(log, "vowels")[0]
    eos = rloo.toy_tokenizer().eos_token
    texts = [p + c + (eos if len(c) < 16 else "") for p, c in zip(call["prompts"], call["completions"])]
    expected = statistics.mean(reward_model_scores(workdir / "reward_other_tokenizer", texts))
    assert other["rewards/reward_model"] == pytest.approx(expected, rel=1e-5, abs=1e-6)
    assert other["rewards/vowels"] == pytest.approx(statistics.mean(call["scores"]))


def gpt2_reward_model(directory, tokenizer, positions):
    """A GPT-2 reward model (learned absolute positions: indexing past them fails) saved with `tokenizer`."""
    from transformers import GPT2Config, GPT2ForSequenceClassification

    config = GPT2Config(vocab_size=len(tokenizer), n_embd=32, n_layer=1, n_head=4, n_positions=positions, num_labels=1)
    config.pad_token_id = tokenizer.pad_token_id
    GPT2ForSequenceClassification(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


@slow
def test_reward_model_context_is_checked_on_re_encoded_text(workdir, tmp_path):
    # another tokenizer: lengths are known only once completions are re-encoded, so the run stops in update 1 with
    # one line (before the check: an IndexError traceback from the position embeddings)
    tokenizer = rloo.toy_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|sep|>"]})
    gpt2_reward_model(tmp_path / "short_reward", tokenizer, positions=48)
    proc = launch(workdir, tmp_path / "out", "--reward-model-path", str(tmp_path / "short_reward"), check=False)
    message = one_line_error(proc)
    assert "--reward-model-path" in message and "beyond its context of 48" in message
    assert "stopped in update 1" in message and not (tmp_path / "out" / "checkpoint-1").exists()


@slow
def test_encoder_reward_model_scores_with_its_own_special_tokens(workdir, tmp_path):
    log = tmp_path / "calls"
    launch(
        workdir,
        tmp_path / "out",
        "--reward-model-path",
        "reward_bert",
        "--reward-fn",
        "test_rewards:vowels",
        "--reward-weights",
        "2",
        "0",
        *SHORT,
        env={"RLOO_TEST_LOG": str(log)},
    )
    call, first = read_calls(log, "vowels")[0], read_metrics(tmp_path / "out")[0]
    expected = statistics.mean(
        reward_model_scores(workdir / "reward_bert", [p + c for p, c in zip(call["prompts"], call["completions"])])
    )
    assert first["rewards/reward_model"] == pytest.approx(expected, rel=1e-5, abs=1e-6)
    assert first["objective/scores"] == pytest.approx(2 * expected, rel=1e-5, abs=1e-6)


# ----------------------------------------------------------------------------------------------------------------
# 15. held-out evaluation


def greedy(model, prompt_ids, length):
    """Greedy decoding by hand: the argmax token, appended, length times (no stop token)."""
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        for _ in range(length):
            ids = torch.cat([ids, model(ids).logits[:, -1].argmax(-1, keepdim=True)], 1)
    return ids[0, len(prompt_ids) :].tolist()


@slow
def test_evaluation_is_on_schedule_and_leaves_training_alone(workdir, tmp_path):
    from transformers import AutoModelForCausalLM

    flags = [*SHORT, "--sft-model-path", "policy", "--learning-rate", "1e-3"]
    evaluation = ["--eval-steps", "3", "--num-eval-prompts", "6"]
    launch(workdir, tmp_path / "plain", *flags)
    launch(workdir, tmp_path / "greedy", *flags, *evaluation)
    launch(workdir, tmp_path / "sampled", *flags, *evaluation, "--eval-temperature", "1.0")
    plain = read_metrics(tmp_path / "plain")
    for name in ["greedy", "sampled"]:  # the same training, metric by metric
        for a, b in zip(plain, read_metrics(tmp_path / name), strict=True):
            assert {k: v for k, v in a.items() if not k.startswith("time/") and k != "eps"} == {
                k: v for k, v in b.items() if not k.startswith("time/") and k != "eps"
            }
        evals = read_metrics(tmp_path / name, "eval")
        assert [m["update"] for m in evals] == [3, 4]  # every 3 updates, and after the last
        records = [json.loads(line) for line in (tmp_path / name / "eval_completions.jsonl").read_text().splitlines()]
        assert [r["update"] for r in records] == [3] * 6 + [4] * 6
        assert [r["prompt"] for r in records[:6]] == rloo.toy_prompts()[:6]
        for m in evals:
            mine = [r for r in records if r["update"] == m["update"]]
            assert all(r["score"] == pytest.approx(10 * sum(c in "aeiou" for c in r["completion"]) / 8) for r in mine)
            assert m["eval/scores"] == pytest.approx(statistics.mean(r["score"] for r in mine))
            assert m["eval/rewards/toy_reward"] == m["eval/scores"] and m["eval/completion_length"] == 8.0
    # greedy: what the final policy decodes by hand (the evaluation after update 4 ran on that policy)
    model, tokenizer = AutoModelForCausalLM.from_pretrained(tmp_path / "greedy").eval(), rloo.toy_tokenizer()
    records = [json.loads(line) for line in (tmp_path / "greedy" / "eval_completions.jsonl").read_text().splitlines()]
    for record in records[6:]:
        expected = tokenizer.decode(
            greedy(model, tokenizer(record["prompt"])["input_ids"], 8), skip_special_tokens=True
        )
        assert record["completion"] == expected


# ----------------------------------------------------------------------------------------------------------------
# 16. LoRA: adapters train, the frozen base is the reference


LORA_FLAGS = [
    *SHORT,
    "--sft-model-path",
    "policy",
    "--learning-rate",
    "1e-2",
    "--use-peft",
    "--lora-r",
    "4",
    "--num-ppo-epochs",
    "1",
    "--save-steps",
    "2",
    "--reward-fn",
    "test_rewards:vowels",
]


@slow
def test_lora_trains_adapters_and_saves_them(workdir, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    out = tmp_path / "out"
    launch(workdir, out, *LORA_FLAGS, "--merge-adapter", "--gradient-checkpointing")
    first = read_metrics(out)[0]
    assert first["objective/kl"] == 0.0 and first["val/ratio"] == 1.0  # B starts at 0: policy == its base
    assert (out / "adapter_config.json").exists() and (out / "adapter_model.safetensors").exists()
    # the checkpoint holds the policy: its base weights are the initial ones, its adapters moved
    base = AutoModelForCausalLM.from_pretrained(workdir / "policy").eval()
    trained = load_weights(out / "checkpoint-4")
    lora = {name: tensor for name, tensor in trained.items() if "lora_" in name}
    assert lora and any(tensor.abs().sum() > 0 for name, tensor in lora.items() if "lora_B" in name)
    frozen = {
        name.replace("base_model.model.", "").replace(".base_layer", ""): tensor
        for name, tensor in trained.items()
        if "lora_" not in name
    }
    assert frozen.keys() == base.state_dict().keys()
    assert all(torch.equal(tensor, base.state_dict()[name]) for name, tensor in frozen.items())
    # the saved adapter, on the base, computes what the merged model does, and not what the base does
    adapter = PeftModel.from_pretrained(copy.deepcopy(base), out).eval()
    merged = AutoModelForCausalLM.from_pretrained(out / "merged").eval()
    ids = torch.randint(0, base.config.vocab_size, (3, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert_close(adapter(ids).logits, merged(ids).logits, rtol=1e-5, atol=1e-5)
        assert not torch.allclose(adapter(ids).logits, base(ids).logits, atol=1e-4)
    saved = {
        name.replace(".weight", ".default.weight"): t
        for name, t in load_weights_file(out / "adapter_model.safetensors").items()
    }
    assert saved.keys() == lora.keys() and all(torch.equal(saved[name], lora[name]) for name in lora)


def load_weights_file(path):
    from safetensors.torch import load_file

    return load_file(str(path))


@slow
def test_lora_run_resumes_bitwise(workdir, tmp_path):
    launch(workdir, tmp_path / "full", *LORA_FLAGS)
    proc = launch(workdir, tmp_path / "cut", *LORA_FLAGS, env={"RLOO_TEST_KILL_AT": "4"}, check=False)
    assert proc.returncode != 0 and [m["update"] for m in read_metrics(tmp_path / "cut")] == [1, 2, 3]
    launch(workdir, tmp_path / "cut", *LORA_FLAGS, "--resume-from-checkpoint", "latest")
    for a, b in zip(read_metrics(tmp_path / "full"), read_metrics(tmp_path / "cut"), strict=True):
        assert [a[key] for key in ("update", "objective/scores", "objective/kl", "loss/policy_avg")] == [
            b[key] for key in ("update", "objective/scores", "objective/kl", "loss/policy_avg")
        ]
    full, cut = (load_weights_file(tmp_path / name / "adapter_model.safetensors") for name in ["full", "cut"])
    assert full.keys() == cut.keys() and all(torch.equal(full[name], cut[name]) for name in full)


def test_lora_flags_are_checked(workdir, tmp_path):
    message = run_main(tmp_path, sft_model_path=str(workdir / "policy"), use_peft=True, lora_target_modules=["no_such"])
    assert "--lora-target-modules" in message and "\n" not in message
    assert "--use-peft" in run_main(tmp_path, merge_adapter=True)
    assert "--lora-dropout" in run_main(tmp_path, use_peft=True, lora_dropout=1.0)
    assert "--lora-r" in run_main(tmp_path, use_peft=True, lora_r=0)


# ----------------------------------------------------------------------------------------------------------------
# 17. real checkpoints: a bf16 Llama whose tokenizer adds BOS, pad == eos


@slow
def test_bf16_checkpoint_trains_float32_master_weights(workdir, tmp_path):
    from transformers import AutoModelForCausalLM

    proc = launch(
        workdir,
        tmp_path / "out",
        "--sft-model-path",
        "llama_bf16",
        "--learning-rate",
        "1e-5",
        "--num-ppo-epochs",
        "1",
        "--stop-token",
        "eos",
        "--cpu-threads",
        "1",
        *SHORT,
    )
    assert "1 CPU threads each" in proc.stdout
    first = read_metrics(tmp_path / "out")[0]
    assert first["objective/kl"] == 0.0 and first["val/ratio"] == 1.0  # the reference computes what the policy does
    trained = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    initial = AutoModelForCausalLM.from_pretrained(workdir / "llama_bf16")
    assert initial.dtype == torch.bfloat16 and trained.dtype == torch.float32
    changed = sum(int((p != initial.state_dict()[n].float()).sum()) for n, p in trained.state_dict().items())
    total = sum(p.numel() for p in trained.parameters())
    # Adam moves every weight with a gradient by about lr per step: far below bf16's spacing near 0.02, so in bf16
    # most of these steps would round away; float32 master weights keep them
    assert changed / total > 0.8, changed / total
    # the prompts this run sampled from: the Llama tokenizer's BOS leads each of them, once
    args = rloo.Args(sft_model_path=str(workdir / "llama_bf16"))
    tokenizer = rloo.load_tokenizer(args)
    prompts, _, _ = rloo.load_prompts(args, tokenizer, None, "train", "--dataset-name")
    assert all(ids[0] == tokenizer.bos_token_id and ids.count(tokenizer.bos_token_id) == 1 for ids in prompts)


# ----------------------------------------------------------------------------------------------------------------
# 18. scale out: ZeRO-3 and DDP on 2 CPU processes, at a shape where ZeRO-3 really shards

# counts the collectives of each process (torch.distributed's functions, wrapped before DeepSpeed binds them) and
# records that count at each sampled token and as the rollout's weights are gathered and released
COUNTING = """
import atexit, json, os
if os.environ.get("RLOO_TEST_COUNT") and "RANK" in os.environ:  # the ranks, not the launcher
    import torch
    import torch.distributed as dist
    count, events = [0], []

    def counted(fn):
        def wrapper(*args, **kwargs):
            count[0] += 1
            return fn(*args, **kwargs)
        return wrapper

    for name in ["all_gather_into_tensor", "_all_gather_base", "all_gather", "all_gather_object", "broadcast",
                 "broadcast_object_list", "all_reduce", "all_reduce_coalesced", "reduce_scatter_tensor",
                 "_reduce_scatter_base", "all_to_all_single", "barrier"]:
        if hasattr(dist, name):
            setattr(dist, name, counted(getattr(dist, name)))
    multinomial = torch.multinomial

    def sample(*args, **kwargs):
        events.append(["sample", count[0]])
        return multinomial(*args, **kwargs)

    torch.multinomial = sample
    from deepspeed.runtime.zero.partition_parameters import GatheredParameters

    enter, leave = GatheredParameters.__enter__, GatheredParameters.__exit__

    def gathered(self):
        result = enter(self)
        events.append(["gathered", count[0]])
        return result

    def released(self, *exc):
        events.append(["released", count[0]])
        return leave(self, *exc)

    GatheredParameters.__enter__, GatheredParameters.__exit__ = gathered, released
    path = os.environ["RLOO_TEST_COUNT"] + "." + os.environ["RANK"]
    atexit.register(lambda: open(path, "w").write(json.dumps(events)))
"""
# matrices of 256 x 1024 elements, above DeepSpeed's stage3_param_persistence_threshold of 1e5: ZeRO-3 shards them
# and gathers them for each use; completions stop at random steps, so ranks sample different numbers of tokens
SCALE_FLAGS = [
    "--sft-model-path",
    "policy_wide",
    "--reward-model-path",
    "reward",
    "--learning-rate",
    "1e-4",
    "--rloo-k",
    "2",
    "--stop-token",
    "eos",
    *SHORT,
    "--response-length",
    "16",
    "--eval-steps",
    "1",
    "--num-eval-prompts",
    "5",
]


@pytest.fixture(scope="session")
def scale_runs(workdir):
    """The same 2-process run six ways: ZeRO-3 with gathered generation (and activation checkpointing), ZeRO-3 on
    the sharded model, DDP, DDP launched with --multi_gpu alone (no ACCELERATE_USE_CPU), and LoRA under ZeRO-3 and
    under DDP."""
    tokenizer = rloo.toy_tokenizer()
    wide = eos_likely(rloo.toy_policy(tokenizer, 5, hidden_size=256, intermediate_size=1024), tokenizer, p=0.35)
    assert max(p.numel() for p in wide.parameters()) == 256 * 1024 > 1e5
    wide.save_pretrained(workdir / "policy_wide")
    tokenizer.save_pretrained(workdir / "policy_wide")
    (workdir / "counting").mkdir(exist_ok=True)
    (workdir / "counting" / "sitecustomize.py").write_text(COUNTING)
    outputs, procs = {}, {}
    runs = [
        ("zero3", "zero3", ["--gradient-checkpointing"]),
        ("zero3_sharded", "zero3", ["--no-ds3-gather-for-generation"]),
        ("ddp", "ddp", []),
        ("multi_gpu", "multi_gpu", []),
        ("zero3_lora", "zero3", ["--use-peft"]),
        ("ddp_lora", "ddp", ["--use-peft"]),
    ]
    for name, backend, extra in runs:
        outputs[name] = workdir / f"scale_{name}"
        env = {"RLOO_TEST_COUNT": str(workdir / f"events_{name}"), "PYTHONWARNINGS": "default"}
        pythonpath = f"{workdir / 'counting'}{os.pathsep}{workdir}"
        procs[name] = launch(
            workdir, outputs[name], *SCALE_FLAGS, *extra, backend=backend, env=env, pythonpath=pythonpath
        )
    return outputs, procs


def read_events(workdir, name, rank):
    return json.loads((workdir / f"events_{name}.{rank}").read_text())


@slow
@pytest.mark.parametrize("name", ["zero3", "zero3_sharded", "ddp", "multi_gpu"])
def test_two_process_runs_write_every_metric(scale_runs, name):
    metrics = read_metrics(scale_runs[0][name])
    assert [m["episode"] for m in metrics] == [16, 32]  # 2 processes x 8 completions per update
    for m in metrics:
        assert set(METRIC_NAMES) <= set(m) and all(math.isfinite(m[n]) for n in METRIC_NAMES)
    threads = max(1, len(os.sched_getaffinity(0)) // 2)  # the machine's cores, shared by the 2 local processes
    assert f"2 processes, {threads} CPU threads each" in scale_runs[1][name].stdout


@slow
@pytest.mark.parametrize("name", ["zero3", "zero3_sharded", "multi_gpu"])
def test_zero3_and_plain_launches_compute_what_ddp_computes(scale_runs, name):
    first, ddp = read_metrics(scale_runs[0][name])[0], read_metrics(scale_runs[0]["ddp"])[0]
    assert ddp["val/num_eos_tokens"] > 0  # completions stopped at different steps
    for key in [
        "objective/scores",
        "objective/kl",
        "objective/entropy",
        "loss/policy_avg",
        "val/ratio",
        "policy/clipfrac_avg",
        "policy/entropy_avg",
    ]:
        assert first[key] == pytest.approx(ddp[key], rel=1e-4, abs=1e-5), key


@slow
def test_multi_gpu_on_cpus_trains_in_sync(scale_runs):
    # without ACCELERATE_USE_CPU, accelerate would not wrap the policy in DDP: rank 1 would train its own copy, and
    # update 2 (sampled by both ranks' policies) would differ from the DDP run's
    plain, ddp = read_metrics(scale_runs[0]["multi_gpu"]), read_metrics(scale_runs[0]["ddp"])
    for a, b in zip(plain, ddp):
        for key in ["objective/scores", "objective/kl", "loss/policy_avg", "val/ratio"]:
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-6), (a["update"], key)


@slow
def test_gathered_generation_makes_no_collective_while_sampling(workdir, scale_runs):
    steps = {}
    for rank in (0, 1):
        events, window = read_events(workdir, "zero3", rank), None
        for kind, count in events:
            if kind == "gathered":
                window = [count]
            elif kind == "sample":
                assert window is not None and count == window[0], "a collective while sampling"
                window.append(count)
            elif window is not None and len(window) > 1:  # released, after a rollout
                assert count == window[0]
                steps.setdefault(rank, []).append(len(window) - 1)
                window = None
        assert len(steps[rank]) == 2  # one rollout per update
    assert steps[0] != steps[1]  # the ranks sampled different numbers of tokens, and never waited for each other
    # the control: on the sharded model, every sampled token follows collectives (gathers, the synced stop check)
    sharded = [count for kind, count in read_events(workdir, "zero3_sharded", 0) if kind == "sample"]
    assert all(b > a for a, b in zip(sharded, sharded[1:]))


@slow
def test_lora_under_zero3_computes_what_it_does_under_ddp(scale_runs):
    zero3, ddp = read_metrics(scale_runs[0]["zero3_lora"]), read_metrics(scale_runs[0]["ddp_lora"])
    assert zero3[0]["objective/kl"] == ddp[0]["objective/kl"] == 0.0  # the reference is the policy, adapters off
    for a, b in zip(zero3, ddp, strict=True):
        for key in ["objective/scores", "objective/kl", "loss/policy_avg", "val/ratio", "policy/clipfrac_avg"]:
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-5), (a["update"], key)


@slow
def test_evaluation_shares_its_prompts_out_under_zero3(scale_runs):
    outputs, ddp = scale_runs[0], read_metrics(scale_runs[0]["ddp"], "eval")
    assert [m["update"] for m in ddp] == [1, 2]
    for name in ["zero3", "zero3_sharded", "multi_gpu"]:
        for a, b in zip(read_metrics(outputs[name], "eval"), ddp, strict=True):
            for key in ["eval/scores", "eval/completion_length", "eval/num_eos_tokens", "eval/rewards/reward_model"]:
                assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-5), (name, key)
        lines = (outputs[name] / "eval_completions.jsonl").read_text().splitlines()
        assert [json.loads(line)["prompt"] for line in lines] == rloo.toy_prompts()[:5] * 2  # none lost, none doubled


@slow
def test_runs_print_no_deprecation_warning_of_their_own(scale_runs):
    stderr = scale_runs[1]["zero3"].stderr  # with --gradient-checkpointing and PYTHONWARNINGS=default
    assert "gradient_checkpointing_enable" not in stderr
    assert not re.search(r"rloo\.py:\d+: \w*Warning", stderr)


@slow
def test_zero3_model_reloads_on_one_process_with_ddp_logits(scale_runs):
    from transformers import AutoModelForCausalLM

    outputs = scale_runs[0]
    zero3 = AutoModelForCausalLM.from_pretrained(outputs["zero3"]).eval()
    ddp = AutoModelForCausalLM.from_pretrained(outputs["ddp"]).eval()
    ids = torch.randint(0, zero3.config.vocab_size, (3, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(zero3(ids).logits, ddp(ids).logits, rtol=1e-4, atol=1e-4)
    initial = AutoModelForCausalLM.from_pretrained(outputs["zero3"].parent / "policy_wide").eval()
    with torch.no_grad():
        assert not torch.allclose(zero3(ids).logits, initial(ids).logits)  # it was trained


# ----------------------------------------------------------------------------------------------------------------
# 19. never lose a run: checkpoints, lineage, the lock, signals, damaged files, failures, the non-finite guard


def test_model_and_data_validation(workdir, tmp_path):
    missing = str(tmp_path / "no_such_model")
    message = run_main(tmp_path, sft_model_path=missing)
    assert "--sft-model-path" in message and "local directory" in message
    message = run_main(tmp_path, reward_model_path=missing)
    assert "--reward-model-path" in message
    assert "exactly 1" in run_main(tmp_path, reward_model_path=str(workdir / "reward_two_labels"))
    # a tokenizer without an eos token cannot serve --stop-token eos
    no_eos = tmp_path / "no_eos"
    tokenizer = rloo.toy_tokenizer()
    tokenizer.eos_token = None
    tokenizer.save_pretrained(no_eos)
    (no_eos / "config.json").write_text((workdir / "policy" / "config.json").read_text())
    assert "--stop-token" in run_main(tmp_path, sft_model_path=str(no_eos), stop_token="eos")
    # datasets: empty, without the field, every prompt too long
    empty, fieldless, long = tmp_path / "empty.jsonl", tmp_path / "fieldless.jsonl", tmp_path / "long.jsonl"
    empty.write_text("")
    fieldless.write_text('{"text": "hello"}\n')
    long.write_text('{"prompt": "' + "x" * 100 + '"}\n')
    assert "--dataset-name" in run_main(tmp_path, dataset_name=str(empty))
    assert "--dataset-text-field" in run_main(tmp_path, dataset_name=str(fieldless))
    assert "--max-prompt-length" in run_main(tmp_path, dataset_name=str(long), max_prompt_length=50)
    # prompts and completion beyond the policy's context (the toy's: 512 positions), or beyond the context of a
    # reward model that reads the policy's tokens (learned positions: it would fail with an IndexError in update 1)
    assert "--response-length" in run_main(tmp_path, response_length=600)
    short_reward = gpt2_reward_model(tmp_path / "short_reward", rloo.toy_tokenizer(), positions=48)
    message = run_main(tmp_path, reward_model_path=str(short_reward))  # the default --response-length is 53
    assert "--response-length" in message and "reward model's context of 48 tokens" in message
    # a reward model that cannot score the prompts: its embeddings stop short of its tokenizer (tokens added, the
    # embeddings never resized), so its forward fails; at start-up, not in update 1
    from transformers import GPTNeoXForSequenceClassification

    config = GPTNeoXForSequenceClassification.config_class.from_pretrained(workdir / "reward")
    config.vocab_size = 20
    GPTNeoXForSequenceClassification(config).save_pretrained(tmp_path / "small_vocab")
    rloo.toy_tokenizer().save_pretrained(tmp_path / "small_vocab")
    message = run_main(tmp_path, reward_model_path=str(tmp_path / "small_vocab"))
    assert "--reward-model-path" in message and "cannot score with this model" in message
    # an output directory that cannot be written, or that is a file
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    assert "--output-dir" in run_main(tmp_path, output_dir=str(blocker / "sub"))
    assert "is a file" in run_main(tmp_path, output_dir=str(blocker))


@slow
def test_a_live_run_holds_its_output_dir(workdir, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (out / ".lock").write_text(f"{socket.gethostname()} {sleeper.pid}")
        message = run_main(tmp_path)
        assert f"another run (pid {sleeper.pid}" in message and "--output-dir" in message
    finally:
        sleeper.kill()
        sleeper.wait()
    # its process gone, the lock is stale: taken over, and released when the run ends (here: a model that fails
    # to load, after the lock was taken)
    no_weights = tmp_path / "no_weights"
    rloo.toy_tokenizer().save_pretrained(no_weights)
    (no_weights / "config.json").write_text((workdir / "policy" / "config.json").read_text())
    assert "--sft-model-path" in run_main(tmp_path, sft_model_path=str(no_weights))
    assert not (out / ".lock").exists()


def test_a_crashed_run_offers_overwrite(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"update": 1}\n')  # it crashed before its first checkpoint
    assert "--overwrite-output-dir" in run_main(tmp_path)
    assert "--overwrite-output-dir" in run_main(tmp_path, resume_from_checkpoint="latest")


def fake_checkpoint(path, world_size=1):
    from safetensors.torch import save_file

    path.mkdir()
    save_file({"w": torch.ones(3)}, str(path / "model.safetensors"))
    for rank in range(world_size):
        torch.save({"python": random_state_like()}, path / f"random_states_{rank}.pkl")
    files = {p.name: p.stat().st_size for p in path.iterdir()}
    state = {"update": 2, "world_size": world_size, "files": files, "args": {}, "score_history": [], "elapsed": 0.0}
    state |= {"skipped_steps": 0, "consecutive_skips": 0}
    (path / "trainer_state.json").write_text(json.dumps(state))


def random_state_like():
    import random

    return random.Random(0).getstate()


def test_read_checkpoint_finds_every_kind_of_damage(tmp_path):
    def problem(name, damage):
        path = tmp_path / name
        fake_checkpoint(path, world_size=2)
        damage(path)
        return rloo.read_checkpoint(str(path))[1]

    assert problem("intact", lambda p: None) is None
    assert "random_states_1.pkl is missing" in problem("no_rng", lambda p: (p / "random_states_1.pkl").unlink())
    truncate = lambda f: f.write_bytes(f.read_bytes()[:-10])  # noqa: E731
    assert "bytes" in problem("cut_rng", lambda p: truncate(p / "random_states_0.pkl"))
    assert "bytes" in problem("cut_model", lambda p: truncate(p / "model.safetensors"))
    garble = lambda f: f.write_bytes(b"\xff" * f.stat().st_size)  # noqa: E731  (the same size, other bytes)
    assert "random_states_0.pkl is unreadable" in problem("bad_rng", lambda p: garble(p / "random_states_0.pkl"))
    assert "model.safetensors is unreadable" in problem("bad_model", lambda p: garble(p / "model.safetensors"))
    assert "trainer_state.json" in problem("bad_state", lambda p: garble(p / "trainer_state.json"))


def test_a_full_disk_is_named(tmp_path, monkeypatch):
    # /dev/full fails every write with ENOSPC, as a full disk does; the device reports 0 bytes free
    (tmp_path / "metrics.jsonl").symlink_to("/dev/full")
    monkeypatch.setattr(rloo.shutil, "disk_usage", lambda path: types.SimpleNamespace(free=0))
    run = types.SimpleNamespace(args=rloo.Args(output_dir=str(tmp_path)), write_error=None)
    rloo.append_lines(run, "metrics.jsonl", [{"update": 1}])
    assert run.write_error == "cannot append to metrics.jsonl: No space left on device (no space left on that device)"
    monkeypatch.setattr(rloo.shutil, "disk_usage", lambda path: types.SimpleNamespace(free=300 * 2**20))
    assert rloo.free_space(str(tmp_path)) == "300 MiB free on that device"


def test_metrics_lines_cut_short_are_dropped(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"update": 1}\n{"update": 2}\n{"update": 3, "epi')
    assert rloo.read_metrics_lines(str(path)) == [{"update": 1}, {"update": 2}]
    path.write_text('{"update": 1}\n{"upd\n{"update": 3}\n')  # damage inside the file is not a cut: refuse
    with pytest.raises(rloo.ArgumentError, match="line 2"):
        rloo.read_metrics_lines(str(path))


def test_checkpoint_dirs_ignore_half_written(tmp_path):
    for name in ["checkpoint-2", "checkpoint-10", "checkpoint-12.tmp", "checkpoint-14"]:
        (tmp_path / name).mkdir()
    for name in ["checkpoint-2", "checkpoint-10", "checkpoint-12.tmp"]:
        (tmp_path / name / "trainer_state.json").write_text("{}")
    assert [pathlib.Path(d).name for d in rloo.checkpoint_dirs(str(tmp_path))] == ["checkpoint-2", "checkpoint-10"]


def test_every_seed_and_rank_has_its_own_stream():
    seeds = [rloo.rank_seed(seed, rank) for seed in range(2000) for rank in range(64)]
    assert len(set(seeds)) == len(seeds)  # seed 42 rank 1 is not seed 43 rank 0


def test_generate_survives_a_diverged_policy():
    class Diverged(torch.nn.Module):  # logits all NaN, as from NaN weights
        def forward(self, input_ids, **kwargs):
            output = type("Output", (), {})()
            output.logits, output.cache = torch.full((len(input_ids), 1, 5), math.nan), None
            return output

    tokens = rloo.generate(
        Diverged(),
        torch.ones(3, 2, dtype=torch.long),
        torch.ones(3, 2, dtype=torch.long),
        4,
        0.7,
        None,
        0,
        synced=False,
    )
    assert tokens.shape == (3, 4) and ((0 <= tokens) & (tokens < 5)).all()


# 6 updates, a checkpoint every 2, and an evaluation every 2 (on 4 prompts), which must keep its schedule on resume
RESUME_FLAGS = [
    "--reward-fn",
    "test_rewards:vowels",
    "--response-length",
    "8",
    "--total-episodes",
    "48",
    "--per-device-train-batch-size",
    "8",
    "--num-sample-generations",
    "0",
    "--save-steps",
    "2",
    "--eval-steps",
    "2",
    "--num-eval-prompts",
    "4",
]


@pytest.fixture(scope="session")
def full_run(workdir):
    """The reference run that interrupted ones must reproduce: 6 updates, checkpoints 2, 4 and 6."""
    launch(workdir, workdir / "full_run", *RESUME_FLAGS)
    return workdir / "full_run"


def copy_run(full_run, tmp_path, name):
    import shutil

    shutil.copytree(full_run, tmp_path / name)
    return tmp_path / name


def assert_resumed_run_matches(full_dir, resumed_dir, exact=True):
    full, resumed = read_metrics(full_dir, "all"), read_metrics(resumed_dir, "all")
    # none missing, none repeated: the updates, and the evaluations on their schedule
    assert [(m["update"], "episode" in m) for m in resumed] == [(m["update"], "episode" in m) for m in full]
    for a, b in zip(full, resumed):
        for key in ["objective/scores", "objective/kl", "loss/policy_avg"] if "episode" in a else ["eval/scores"]:
            assert a[key] == b[key] if exact else a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-5)
    for name, tensor in load_weights(full_dir).items():
        other = load_weights(resumed_dir)[name]
        if exact:
            assert torch.equal(tensor, other), name
        else:
            torch.testing.assert_close(tensor, other, rtol=1e-4, atol=1e-5)


def one_line_error(proc):
    """rloo.py's own one-line message, and no traceback from rloo.py (a launcher may add its own report)."""
    lines = [line for line in proc.stderr.splitlines() if line.startswith("rloo.py: ")]
    assert proc.returncode != 0 and lines and 'rloo.py", line' not in proc.stderr, proc.stderr[-3000:]
    return lines[-1]


@slow
def test_resume_validation(workdir, tmp_path):
    assert "--resume-from-checkpoint" in run_main(tmp_path, resume_from_checkpoint=str(tmp_path / "nothing"))
    assert "no intact checkpoint" in run_main(tmp_path, resume_from_checkpoint="latest")
    launch(workdir, tmp_path / "out", *SHORT)
    # a new run may not overwrite the finished one, unless told to
    message = run_main(tmp_path, response_length=8, total_episodes=32)
    assert "already holds a run" in message and "--overwrite-output-dir" in message
    assert len(read_metrics(tmp_path / "out")) == 4
    # flags that change what an update computes must match the checkpoint's
    message = run_main(tmp_path, resume_from_checkpoint="latest", rloo_k=4, response_length=8, total_episodes=32)
    assert "--rloo-k 2" in message
    # a checkpoint written by another number of processes is refused
    checkpoint = tmp_path / "out" / "checkpoint-4"
    (checkpoint / "random_states_1.pkl").write_bytes((checkpoint / "random_states_0.pkl").read_bytes())
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    state["world_size"], state["files"]["random_states_1.pkl"] = 2, state["files"]["random_states_0.pkl"]
    (checkpoint / "trainer_state.json").write_text(json.dumps(state))
    assert "--num_processes 2" in run_main(tmp_path, resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-4"))
    # --overwrite-output-dir starts over: the old checkpoints and metrics are gone
    launch(workdir, tmp_path / "out", *SHORT, "--total-episodes", "16", "--overwrite-output-dir")
    assert len(read_metrics(tmp_path / "out")) == 2
    assert sorted(p.name for p in (tmp_path / "out").glob("checkpoint-*")) == ["checkpoint-2"]


@slow
def test_preempted_run_resumes_bitwise(workdir, full_run, tmp_path):
    import resource

    # the reward function sends SIGTERM to its own process during update 2 (call 1 is the start-up check): the
    # run stops after update 2 without the evaluation due then, which the resume owes
    proc = launch(workdir, tmp_path / "cut", *RESUME_FLAGS, env={"RLOO_TEST_KILL_AT": "3"}, check=False)
    assert proc.returncode == 143 and "--resume-from-checkpoint latest" in proc.stderr
    assert [m["update"] for m in read_metrics(tmp_path / "cut", "all")] == [1, 2]  # no evaluation record
    assert (tmp_path / "cut" / "checkpoint-2").is_dir() and not (tmp_path / "cut" / "model.safetensors").exists()
    # a checkpoint left half-written by a kill while saving must be ignored by `latest`, and a metrics line cut
    # short by a crash while appending is dropped
    (tmp_path / "cut" / "checkpoint-5.tmp").mkdir()
    with open(tmp_path / "cut" / "metrics.jsonl", "a") as f:
        f.write('{"update": 3, "epis')
    # the disk fills up: files may not grow past 100 kB, so checkpoint-4 cannot be written. This attempt first
    # evaluates after update 2 (owed), then runs updates 3 and 4
    limit = lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, 100_000))  # noqa: E731
    proc = launch(
        workdir, tmp_path / "cut", *RESUME_FLAGS, "--resume-from-checkpoint", "latest", check=False, preexec_fn=limit
    )
    message = one_line_error(proc)
    assert "cannot write" in message and "checkpoint-4.tmp" in message and "free" in message
    assert not (tmp_path / "cut" / "checkpoint-4.tmp").exists()
    assert rloo.read_checkpoint(str(tmp_path / "cut" / "checkpoint-2"))[1] is None  # the last one is intact
    assert [m["update"] for m in read_metrics(tmp_path / "cut", "eval")] == [2, 4]
    # resumed without --total-episodes: the checkpoint's value holds, not num_train_epochs x prompts
    without_total = [flag for flag in RESUME_FLAGS if flag not in ("--total-episodes", "48")]
    launch(workdir, tmp_path / "cut", *without_total, "--resume-from-checkpoint", "latest")
    assert_resumed_run_matches(full_run, tmp_path / "cut")  # the evaluation after update 2 is there once
    full_completions = (full_run / "eval_completions.jsonl").read_text()
    assert (tmp_path / "cut" / "eval_completions.jsonl").read_text() == full_completions


@slow
def test_resuming_an_older_checkpoint_abandons_the_newer_ones(workdir, full_run, tmp_path):
    out = copy_run(full_run, tmp_path, "out")
    # a new lineage from checkpoint-2 (another KL coefficient), preempted during update 4: it writes checkpoint-4
    flags = [*RESUME_FLAGS, "--kl-coef", "0.5", "--save-total-limit", "2"]
    proc = launch(
        workdir,
        out,
        *flags,
        "--resume-from-checkpoint",
        str(out / "checkpoint-2"),
        env={"RLOO_TEST_KILL_AT": "3"},
        check=False,
    )
    assert proc.returncode != 0 and "abandons" in proc.stderr
    (aside,) = out.glob("abandoned-*")
    assert sorted(p.name for p in aside.glob("checkpoint-*")) == ["checkpoint-4", "checkpoint-6"]
    assert [m["update"] for m in read_metrics(aside)] == [3, 4, 5, 6] and (aside / "model.safetensors").exists()
    # `latest` now continues the new lineage, not the abandoned run's checkpoint-6
    launch(workdir, out, *flags, "--resume-from-checkpoint", "latest")
    metrics = read_metrics(out)
    assert [m["update"] for m in metrics] == [1, 2, 3, 4, 5, 6]
    for m in metrics:
        kl_coef = 0.05 if m["update"] <= 2 else 0.5
        assert m["objective/non_score_reward"] == pytest.approx(-kl_coef * m["objective/kl"], abs=1e-6)
    # --save-total-limit 2 kept the new lineage's two newest checkpoints
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-4", "checkpoint-6"]
    assert json.loads((out / "checkpoint-6" / "trainer_state.json").read_text())["args"]["kl_coef"] == 0.5


@slow
def test_resuming_into_another_directory(workdir, full_run, tmp_path, monkeypatch):
    monkeypatch.chdir(workdir)
    other = tmp_path / "other"
    other.mkdir()
    (other / "metrics.jsonl").write_text('{"update": 1}\n')  # another run's
    message = run_main(
        tmp_path,
        output_dir=str(other),
        resume_from_checkpoint=str(full_run / "checkpoint-4"),
        reward_fn=["test_rewards:vowels"],
        response_length=8,
        total_episodes=48,
    )
    assert "belongs to another run" in message and (other / "metrics.jsonl").read_text() == '{"update": 1}\n'
    # into an empty directory it continues that run, with its metrics so far
    checkpoint = str(full_run / "checkpoint-4") + "/"  # as a shell completes it: the same directory
    launch(workdir, tmp_path / "empty", *RESUME_FLAGS, "--resume-from-checkpoint", checkpoint)
    assert_resumed_run_matches(full_run, tmp_path / "empty")


@slow
def test_damaged_checkpoints(workdir, full_run, tmp_path, monkeypatch):
    out = copy_run(full_run, tmp_path, "out")
    monkeypatch.chdir(workdir)
    rng = out / "checkpoint-6" / "random_states_0.pkl"
    rng.write_bytes(rng.read_bytes()[:-20])
    optimizer = out / "checkpoint-4" / "optimizer.bin"
    optimizer.write_bytes(optimizer.read_bytes()[:100])
    for checkpoint, name in [("checkpoint-6", "random_states_0.pkl"), ("checkpoint-4", "optimizer.bin")]:
        message = run_main(tmp_path, output_dir=str(out), resume_from_checkpoint=str(out / checkpoint))
        assert "is damaged" in message and name in message and "\n" not in message
    # `latest` falls back to the newest intact checkpoint, with a warning, and the run ends as the full one did
    proc = launch(workdir, out, *RESUME_FLAGS, "--resume-from-checkpoint", "latest")
    assert "checkpoint-6 is damaged" in proc.stderr and "checkpoint-4 is damaged" in proc.stderr
    assert "resumed from" in proc.stdout and "checkpoint-2 at update 2" in proc.stdout
    assert_resumed_run_matches(full_run, out)


@slow
@pytest.mark.parametrize(
    "failure, call, checkpoint",
    [
        ("RLOO_TEST_RAISE_AT", "6", "checkpoint-3"),
        ("RLOO_TEST_EXIT_AT", "6", "checkpoint-3"),
        ("RLOO_TEST_RAISE_AT", "4", "checkpoint-2"),
    ],
)
def test_a_failing_reward_function_stops_with_a_checkpoint(workdir, full_run, tmp_path, failure, call, checkpoint):
    # the function's calls are the start-up check, updates 1 and 2, the evaluation after update 2, update 3, then
    # update 4. Failing in update 4 (call 6): updates 1-3 are done, and checkpoint-3 keeps them. Failing in the
    # evaluation (call 4): checkpoint-2, and the resume evaluates first
    proc = launch(workdir, tmp_path / "out", *RESUME_FLAGS, env={failure: call}, check=False)
    message = one_line_error(proc)
    assert "--reward-fn test_rewards:vowels raised" in message and checkpoint in message
    assert ("ValueError: the grader is down" if failure == "RLOO_TEST_RAISE_AT" else "SystemExit: 0") in message
    assert not (tmp_path / "out" / "model.safetensors").exists()
    launch(workdir, tmp_path / "out", *RESUME_FLAGS, "--resume-from-checkpoint", "latest")
    assert_resumed_run_matches(full_run, tmp_path / "out")  # the failed update was sampled again, the same way


@slow
@pytest.mark.parametrize("value", ["nan", "inf"])
def test_non_finite_rewards_trip_the_guard(workdir, tmp_path, value):
    flags = [
        "--reward-fn",
        "test_rewards:vowels",
        "--response-length",
        "8",
        "--total-episodes",
        "80",
        "--num-sample-generations",
        "0",
        "--save-steps",
        "1",
    ]
    env = {"RLOO_TEST_NAN_FROM": "4", "RLOO_TEST_NAN_VALUE": value}
    message = one_line_error(launch(workdir, tmp_path / "out", *flags, env=env, check=False))
    assert "non-finite scores" in message
    metrics = read_metrics(tmp_path / "out")
    assert [m["train/skipped_steps"] for m in metrics] == [0, 0, 1, 2, 3]  # updates 3, 4 and 5 got NaN or inf
    # the skipped updates changed nothing: the final checkpoint holds the weights of the last good update
    last_good, final = tmp_path / "out" / "checkpoint-2", tmp_path / "out" / "checkpoint-5"
    for name, tensor in load_weights(last_good).items():
        assert torch.equal(tensor, load_weights(final)[name]), name


@slow
def test_a_diverged_policy_stops_with_one_line(workdir, tmp_path):
    # a vanishing temperature: logits / temperature overflow, so sampling and log-probs meet NaN
    proc = launch(workdir, tmp_path / "out", *SHORT, "--total-episodes", "48", "--temperature", "1e-40", check=False)
    message = one_line_error(proc)
    assert "log-probs were not finite" in message and "--temperature" in message and "--learning-rate" in message
    assert [m["train/skipped_steps"] for m in read_metrics(tmp_path / "out")] == [1, 2, 3]
    assert not list((tmp_path / "out").glob("checkpoint-*"))  # no checkpoint of a diverged state


def wait_for(condition, timeout=120):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


@slow
def test_signals_and_the_lock(workdir, tmp_path):
    """SIGTERM: the update ends, a checkpoint, exit 143; meanwhile a second run into the directory is refused.
    Two SIGINTs: exit 130 at once."""
    slow_env = subprocess_env(pythonpath=workdir, RLOO_TEST_SLEEP=str(tmp_path / "slow"))
    command = [sys.executable, RLOO_PY, *RESUME_FLAGS, "--save-steps", "1", "--output-dir"]
    calls = lambda: len((tmp_path / "slow.calls").read_text()) if (tmp_path / "slow.calls").exists() else 0  # noqa: E731
    first = subprocess.Popen(
        [*command, str(tmp_path / "out")], cwd=workdir, env=slow_env, stderr=subprocess.PIPE, text=True
    )
    wait_for(lambda: calls() >= 3)  # the start-up check, update 1, and now update 2
    second = subprocess.run(
        [*command, str(tmp_path / "out"), "--resume-from-checkpoint", "latest"],
        cwd=workdir,
        env=subprocess_env(pythonpath=workdir),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert f"another run (pid {first.pid}" in one_line_error(second)
    first.send_signal(signal.SIGTERM)
    assert first.wait(timeout=120) == 143
    done = int(re.search(r"stopped by SIGTERM after update (\d+)", first.stderr.read()).group(1))
    assert len(read_metrics(tmp_path / "out")) == done and (tmp_path / "out" / f"checkpoint-{done}").is_dir()
    launch(workdir, tmp_path / "out", *RESUME_FLAGS, "--resume-from-checkpoint", "latest")
    assert [m["update"] for m in read_metrics(tmp_path / "out")] == [1, 2, 3, 4, 5, 6]
    # two Ctrl-C's: the second one does not wait for the update to end
    (tmp_path / "slow.calls").unlink()
    third = subprocess.Popen(
        [*command, str(tmp_path / "twice")], cwd=workdir, env=slow_env, stderr=subprocess.PIPE, text=True
    )
    wait_for(lambda: calls() >= 2)  # in update 1, whose reward takes a second
    third.send_signal(signal.SIGINT)
    time.sleep(0.2)
    third.send_signal(signal.SIGINT)
    assert third.wait(timeout=60) == 130 and "stopped at once" in third.stderr.read()
    assert not list((tmp_path / "twice").glob("checkpoint-*")) and not (tmp_path / "twice" / ".lock").exists()


@slow
def test_ctrl_c_under_accelerate_launch(workdir, tmp_path):
    calls = lambda: len((tmp_path / "slow.calls").read_text()) if (tmp_path / "slow.calls").exists() else 0  # noqa: E731
    command = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--num_processes",
        "1",
        "--num_machines",
        "1",
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
        RLOO_PY,
        *RESUME_FLAGS,
        "--output-dir",
        str(tmp_path / "out"),
    ]
    env = subprocess_env(pythonpath=workdir, RLOO_TEST_SLEEP=str(tmp_path / "slow"))
    launcher = subprocess.Popen(
        command, cwd=workdir, env=env, start_new_session=True, stderr=subprocess.PIPE, text=True
    )
    wait_for(lambda: calls() >= 3)
    os.killpg(launcher.pid, signal.SIGINT)  # what Ctrl-C in a terminal does: the whole process group
    assert launcher.wait(timeout=120) != 0
    wait_for(lambda: not (tmp_path / "out" / ".lock").exists())  # rloo.py itself finished its update and stopped
    assert (tmp_path / "out" / "checkpoint-2").is_dir()
    launch(workdir, tmp_path / "out", *RESUME_FLAGS, "--resume-from-checkpoint", "latest")
    assert [m["update"] for m in read_metrics(tmp_path / "out")] == [1, 2, 3, 4, 5, 6]


@slow
def test_preempted_zero3_run_resumes(workdir, tmp_path):
    # 2 processes: 16 completions per update, 6 updates
    flags = [*RESUME_FLAGS, "--sft-model-path", str(workdir / "policy"), "--total-episodes", "96"]
    launch(workdir, tmp_path / "full", *flags, backend="zero3")
    proc = launch(workdir, tmp_path / "cut", *flags, backend="zero3", env={"RLOO_TEST_KILL_AT": "4"}, check=False)
    assert proc.returncode != 0
    assert [m["update"] for m in read_metrics(tmp_path / "cut")] == [1, 2, 3]
    launch(workdir, tmp_path / "cut", *flags, "--resume-from-checkpoint", "latest", backend="zero3")
    assert_resumed_run_matches(tmp_path / "full", tmp_path / "cut", exact=False)
