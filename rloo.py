"""RLOO (REINFORCE Leave-One-Out) in one file: fine-tune a language model against a reward.

Ahmadian et al. 2024, "Back to Basics: Revisiting REINFORCE Style Optimization for Learning from Human Feedback".
For each prompt, sample k completions; each completion's advantage is its reward minus the mean reward of the
other k-1 completions of the same prompt. No value network, no GAE: one policy, a frozen reference and a reward.

    # the embedded toy task (a tiny random policy learns to write vowels): offline, about 40 s on 2 CPU cores
    accelerate launch rloo.py --rloo-k 4
    python rloo.py --rloo-k 4                                        # the same, one process, no launcher

    # a real run: Pythia-1B on TL;DR, DeepSpeed ZeRO-3 on 8 GPUs (README.md has the full recipe)
    accelerate launch --config_file ds_zero3.yaml rloo.py \
        --sft-model-path cleanrl/EleutherAI_pythia-1b-deduped__sft__tldr \
        --reward-model-path cleanrl/EleutherAI_pythia-1b-deduped__reward__tldr \
        --dataset-name trl-internal-testing/tldr-preference-sft-trl-style --dataset-text-field prompt \
        --rloo-k 2 --learning-rate 3e-6 --per-device-train-batch-size 16 --gradient-accumulation-steps 4 \
        --total-episodes 1000000 --stop-token eos --missing-eos-penalty 1.0 --response-length 53

    # CPUs only: two processes of ZeRO-3 over gloo
    accelerate launch --config_file ds_zero3.yaml --num_processes 2 --mixed_precision no rloo.py

How to read it: `Args` (every flag); the ALGO LOGIC helpers, each with its equation; the toy task; `train`, the
loop, steps 1-10 in the algorithm's order: rollout -> truncation -> log-probs -> reward -> missing-EOS penalty ->
reward normalization and clipping -> KL -> leave-one-out advantages -> clipped update epochs -> metrics. Everything
after the PLUMBING marker (setup, checkpoints, metric reduction, reports) can be skipped on a first read.
"""

import contextlib
import functools
import glob
import importlib
import importlib.util
import inspect
import json
import math
import os
import random
import re
import resource
import shutil
import signal
import socket
import sys
import time
import warnings
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Literal, Optional

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
import tyro
from tyro.conf import Suppress


@dataclass
class Args:
    # ---- experiment
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    """the name of this experiment"""
    run_name: Optional[str] = None
    """a unique name for this run; None: `{exp_name}__{seed}__{unix time}`"""
    seed: int = 42
    """seed of the run; rank r samples with seed + 100003 r"""
    output_dir: Optional[str] = None
    """where metrics, checkpoints and the final model go; None: `runs/{run_name}`"""
    report_to: Literal["none", "tensorboard", "wandb"] = "none"
    """also log metrics to this tracker (through accelerate)"""
    push_to_hub: bool = False
    """push the final model to the Hugging Face hub"""
    hub_model_id: Optional[str] = None
    """the hub repository to push to; None: the run name"""

    # ---- models and data
    sft_model_path: Optional[str] = None
    """the policy to fine-tune: a hub id or a local directory; None: the embedded toy policy"""
    reward_model_path: Optional[str] = None
    """the reward model (a sequence classifier with one label): a hub id or a local directory"""
    reward_fn: Optional[list[str]] = None
    """reward functions, each `module:function`: fn(prompts, completions, **columns) -> list[float], given the
    dataset's other columns that it names (README: "Reward functions"); with no reward model: the toy's reward"""
    reward_weights: Optional[list[float]] = None
    """one weight per reward source, the reward model first, then each reward function; None: 1.0 each"""
    trust_remote_code: bool = False
    """allow models and tokenizers with custom code"""
    dataset_name: Optional[str] = None
    """prompts: a hub dataset, a local dataset directory or a .jsonl file; None: the toy prompts"""
    dataset_split: str = "train"
    """the split of the dataset to train on"""
    dataset_text_field: str = "prompt"
    """the field holding each prompt: a string, or a list of chat messages rendered with the chat template"""
    max_prompt_length: int = 512
    """prompts with more tokens than this are left out"""

    # ---- rollout
    response_length: int = 53
    """the most tokens sampled per completion"""
    stop_token: Optional[Literal["eos"]] = None
    """`eos`: stop a completion at the tokenizer's eos token (and truncate after it)"""
    stop_token_id: Optional[int] = None
    """stop a completion at this token id (`--stop-token eos` sets it to the eos id)"""
    temperature: float = 0.7
    """sampling temperature; log-probs are computed from logits divided by it too"""
    missing_eos_penalty: Optional[float] = None
    """subtracted from the score of completions that never produced the stop token (0 or more)"""
    local_rollout_forward_batch_size: int = 64
    """completions generated and scored per forward pass during the rollout"""

    # ---- RLOO
    rloo_k: int = 2
    """completions sampled per prompt (the k of RLOO)"""
    kl_coef: float = 0.05
    """weight of the KL penalty against the reference policy"""
    token_level_kl: bool = False
    """put the KL penalty on each token's advantage (True) or into the sequence reward (False)"""
    normalize_reward: bool = False
    """z-score the scores over the global batch"""
    reward_clip_range: float = 10.0
    """clip the scores to [-c, c]"""
    whiten_rewards: bool = False
    """divide the rewards entering the baseline by their standard deviation over the global batch"""
    normalize_advantage: bool = False
    """z-score the advantages over the global batch"""

    # ---- optimization
    total_episodes: Optional[int] = None
    """completions to train on; None: num_train_epochs x the number of prompts"""
    num_train_epochs: float = 3.0
    """sets total_episodes = num_train_epochs x the number of prompts when it is not given (TRL's convention); an
    episode is one completion, so that is num_train_epochs / rloo_k passes over the prompts"""
    per_device_train_batch_size: int = 8
    """completions per micro-batch on each process"""
    gradient_accumulation_steps: int = 1
    """micro-batches accumulated into each optimizer step"""
    num_mini_batches: int = 1
    """optimizer steps per epoch over the rollout batch"""
    num_ppo_epochs: int = 4
    """passes over each rollout batch"""
    learning_rate: Optional[float] = None
    """AdamW learning rate, decayed linearly to 0; None: 1e-3 for the toy policy, TRL's 5e-5 for any other"""
    cliprange: float = 0.2
    """the PPO clip range epsilon of the probability ratio"""
    max_grad_norm: float = 1.0
    """clip the gradient norm to this before each optimizer step; 0: no clipping"""
    cpu_threads: Optional[int] = None
    """threads per process on a machine without CUDA; None: the machine's cores shared among its processes
    (accelerate launch sets OMP_NUM_THREADS=1, which this overrides)"""
    gradient_checkpointing: bool = False
    """recompute activations in the backward pass to save memory"""
    ds3_gather_for_generation: bool = True
    """under ZeRO-3, gather the policy's weights once for generation (False: generate on the sharded model)"""
    num_sample_generations: int = 10
    """print a table of prompts, completions and scores this many times per run"""

    # ---- LoRA (peft), with TRL's ModelConfig names
    use_peft: bool = False
    """train LoRA adapters on the frozen policy; the reference is that policy with its adapters switched off, so no
    second copy of the model is loaded"""
    lora_r: int = 16
    """the rank of each adapter"""
    lora_alpha: int = 32
    """the adapters' scale is lora_alpha / lora_r"""
    lora_dropout: float = 0.05
    """kept for TRL's config: rloo.py turns every dropout off, LoRA's too, since the rollout's log-probs and the
    update's must come from the same function"""
    lora_target_modules: Optional[list[str]] = None
    """the modules (names or name suffixes) that get adapters; None: every linear layer but the output head"""
    lora_task_type: str = "CAUSAL_LM"
    """peft's task type of the policy"""
    merge_adapter: bool = False
    """also save the policy with its adapters merged in, as a plain model in output_dir/merged"""

    # ---- held-out evaluation
    eval_steps: int = 0
    """evaluate every this many updates and after the last; 0: never"""
    eval_dataset_name: Optional[str] = None
    """held-out prompts: a hub dataset, a local dataset directory or a .jsonl file; None: --dataset-name"""
    eval_split: str = "test"
    """the split of the evaluation dataset (a .jsonl file has none)"""
    num_eval_prompts: Optional[int] = None
    """evaluate on the first N prompts of the evaluation dataset; None: all"""
    eval_temperature: float = 0.0
    """0: greedy decoding; above 0: sampling at this temperature, from a random stream of its own"""

    # ---- checkpoints
    save_steps: int = 500
    """write a checkpoint every this many updates (and at the end)"""
    save_total_limit: Optional[int] = None
    """keep only the newest N checkpoints; None: keep all"""
    resume_from_checkpoint: Optional[str] = None
    """continue from a checkpoint directory, or `latest` (the newest intact one in output_dir)"""
    overwrite_output_dir: bool = False
    """start a new run in an output_dir that holds another run's metrics and checkpoints, deleting them"""

    # ---- derived by resolve_args from the flags above (TRL's names); not set on the command line
    world_size: Suppress[int] = 1
    """processes in the run"""
    local_batch_size: Suppress[int] = 0
    """completions per update on each process: per_device_train_batch_size x gradient_accumulation_steps x
    num_mini_batches"""
    batch_size: Suppress[int] = 0
    """completions per update, over every process"""
    local_dataloader_batch_size: Suppress[int] = 0
    """prompts per update on each process (B): local_batch_size / rloo_k"""
    num_total_batches: Suppress[int] = 0
    """updates in the run: ceil(total_episodes / batch_size)"""


# the toy task: lowercase vowels are what the reward counts
TOY_VOWELS = set("aeiou")


class ArgumentError(SystemExit):
    """Bad input: a one-line message naming the flag, a non-zero exit, no traceback."""

    def __init__(self, message):
        super().__init__(f"rloo.py: error: {message}")


# ================================================================================================================
# ALGO LOGIC: the math of RLOO, one small helper per equation


def first_true_indices(bools):
    """Index of the first True in each row of `bools` (N, T); T where a row has none."""
    row_len = bools.size(-1)
    zero_or_index = row_len * (~bools).long() + torch.arange(row_len, device=bools.device)
    return torch.min(zero_or_index, dim=-1).values


def truncate_response(responses, stop_token_id, pad_token_id):
    """Cut each response after its first stop token (kept) and fill the rest with pad.

    Returns (responses, response_mask), both (N, T). The mask comes from positions, never from comparing ids
    with the pad id, so a tokenizer whose pad is its eos works too."""
    T = responses.shape[1]
    lengths = torch.full((responses.shape[0],), T, device=responses.device)
    if stop_token_id is not None:
        lengths = torch.clamp(first_true_indices(responses == stop_token_id) + 1, max=T)
    response_mask = torch.arange(T, device=responses.device)[None, :] < lengths[:, None]
    return torch.where(response_mask, responses, pad_token_id), response_mask


def has_stop_token(responses, response_mask, stop_token_id):
    """(N,) whether each completion produced the stop token (all False without one)."""
    if stop_token_id is None:
        return torch.zeros(len(responses), dtype=torch.bool, device=responses.device)
    return ((responses == stop_token_id) & response_mask).any(1)


def all_reduce_sum(tensor):
    """Sum a tensor over every process (a no-op on one process)."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        tensor = tensor.clone()
        dist.all_reduce(tensor)
    return tensor


def global_mean_var(values, mask=None):
    """Mean and unbiased variance of values[mask] over every process, so that no statistic depends on how the
    global batch is split across ranks. Two passes (mean, then squared deviations), one all-reduce each."""
    mask = torch.ones_like(values, dtype=torch.bool) if mask is None else mask
    count, total = all_reduce_sum(torch.stack([mask.sum().to(values.dtype), torch.where(mask, values, 0.0).sum()]))
    mean = total / count
    squared = all_reduce_sum(torch.where(mask, (values - mean) ** 2, 0.0).sum())
    return mean, squared / (count - 1).clamp(min=1)


def whiten(values, mask=None, shift_mean=True):
    """(values - mean) / std over the global batch; with shift_mean=False the mean is kept: unit variance only."""
    mean, var = global_mean_var(values, mask)
    whitened = (values - mean) * torch.rsqrt(var + 1e-8)
    return whitened if shift_mean else whitened + mean


def rloo_advantages(rewards, rloo_k):
    """Leave-one-out advantages of rewards (k*B,) laid out k-major: row i*B + j is sample i of prompt j.

    A_i = r_i - (sum_j r_j - r_i) / (k - 1), the sums over the k samples of the same prompt. The baseline leaves
    the sample itself out, so it does not depend on that sample's action and the gradient estimate stays unbiased."""
    rewards = rewards.view(rloo_k, -1)  # (k, B)
    baseline = (rewards.sum(0, keepdim=True) - rewards) / (rloo_k - 1)
    return (rewards - baseline).flatten()  # (k*B,)


def log_ratio(new_logprobs, old_logprobs, response_mask, sequence_level):
    """log(pi_new / pi_old): per sequence, sum_t (logp_t - old_logp_t) over real tokens, (N,); or per token, (N, T).
    Masked positions are zeroed with `where`, so whatever they hold (even inf or NaN) cannot leak in."""
    diff = torch.where(response_mask, new_logprobs - old_logprobs, 0.0)
    return diff.sum(1) if sequence_level else diff


def masked_mean(values, mask):
    return torch.where(mask, values, 0.0).sum() / mask.sum().clamp(min=1)


def policy_loss(new_logprobs, old_logprobs, advantages, response_mask, cliprange):
    """The PPO-clip surrogate: loss = max(-A * ratio, -A * clip(ratio, 1 - eps, 1 + eps)).

    advantages (N,): sequence mode, ratio = exp(sum_t (logp_t - old_logp_t)), averaged over sequences.
    advantages (N, T): token mode, ratio_t = exp(logp_t - old_logp_t), averaged over real tokens.
    Returns (loss, clipfrac): clipfrac is the fraction of terms where the clipped side is the larger."""
    sequence_level = advantages.dim() == 1
    ratio = torch.exp(log_ratio(new_logprobs, old_logprobs, response_mask, sequence_level))
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - cliprange, 1.0 + cliprange)
    losses, is_clipped = torch.max(unclipped, clipped), (clipped > unclipped).float()
    if sequence_level:
        return losses.mean(), is_clipped.mean()
    return masked_mean(losses, response_mask), masked_mean(is_clipped, response_mask)


def token_level_advantages(scores, kl, response_mask, kl_coef, rloo_k, whiten_rewards=False):
    """Token-mode advantages (N, T): A_t = LOO(score) - kl_coef * sum_{t' >= t} kl_t'.

    Each token pays its own KL and those after it (its return-to-go), while the score gets the leave-one-out
    baseline. With whiten_rewards, the per-token rewards r_t = -kl_coef * kl_t (+ score at the last token) are
    divided by their standard deviation over the real tokens of the global batch, and not shifted: the advantages
    become the plain ones times 1/std (README: "Whitening in token mode" says why not shifted)."""
    non_score = torch.where(response_mask, -kl_coef * kl, 0.0)  # (N, T)
    if whiten_rewards:
        last = response_mask.sum(1) - 1
        token_rewards = non_score.clone()
        token_rewards[torch.arange(len(scores), device=scores.device), last] += scores
        _, var = global_mean_var(token_rewards, response_mask)
        scale = torch.rsqrt(var + 1e-8)
        scores, non_score = scores * scale, non_score * scale
    # reversed cumulative sum: the KL paid from token t to the end
    kl_to_go = non_score.flip(1).cumsum(1).flip(1)
    return rloo_advantages(scores, rloo_k)[:, None] + kl_to_go


def logprobs_from_logits(logits, tokens, temperature, with_entropy=False):
    """log softmax(logits / temperature)[token] in float32, one row at a time so that no (N, T, V) float32 copy
    of bf16 logits is ever made. With with_entropy, also the entropy of each position's distribution (no grad)."""
    logprobs, entropies = [], []
    for row_logits, row_tokens in zip(logits, tokens):
        row = row_logits.float() / temperature  # (T, V)
        logsumexp = row.logsumexp(-1)
        logprobs.append(row.gather(-1, row_tokens[:, None]).squeeze(-1) - logsumexp)
        if with_entropy:
            with torch.no_grad():
                entropies.append(logsumexp - (torch.softmax(row, -1) * row).sum(-1))
    return torch.stack(logprobs), (torch.stack(entropies) if with_entropy else None)


def forward_logprobs(model, query_responses, attention_mask, context_length, temperature, with_entropy=False):
    """Log-probs (N, T) of the response tokens query_responses[:, context_length:] under `model`.
    Only the T + 1 last positions get logits (`logits_to_keep`): the prompt positions need no vocabulary matmul."""
    # left padding: positions count real tokens only, as they did during generation
    position_ids = (attention_mask.cumsum(1) - 1).clamp(min=0)
    T = query_responses.shape[1] - context_length
    logits = model(
        input_ids=query_responses,
        attention_mask=attention_mask,
        position_ids=position_ids,
        logits_to_keep=T + 1,
        use_cache=False,
    ).logits[:, :-1]  # (N, T, V): logits at position p predict token p + 1
    return logprobs_from_logits(logits, query_responses[:, context_length:], temperature, with_entropy)


def batched_logprobs(model, query_responses, attention_mask, context_length, temperature, rows):
    """forward_logprobs in chunks of `rows` completions, concatenated: (N, T)."""
    chunks = [
        forward_logprobs(
            model, query_responses[i : i + rows], attention_mask[i : i + rows], context_length, temperature
        )
        for i in range(0, len(query_responses), rows)
    ]
    return torch.cat([logprobs for logprobs, _ in chunks])


def get_reward(reward_model, query_responses, attention_mask, last_index):
    """The reward model's value at the last real token of each prompt+response: its backbone's hidden states,
    its `score` head, then one position per row (a sequence classifier's own pooling looks for the pad id)."""
    position_ids = (attention_mask.cumsum(1) - 1).clamp(min=0)
    backbone = getattr(reward_model, reward_model.base_model_prefix)
    hidden = backbone(input_ids=query_responses, attention_mask=attention_mask, position_ids=position_ids)
    rows = torch.arange(len(query_responses), device=query_responses.device)
    values = reward_model.score(hidden.last_hidden_state[rows, last_index.to(rows.device)])  # (N, 1)
    return values.squeeze(-1).float()


@torch.no_grad()
def generate(model, queries, query_mask, response_length, temperature, stop_token_id, pad_token_id, synced):
    """Sample up to response_length tokens per row with a KV cache: softmax(logits / temperature), no top-k or
    top-p; temperature 0 is greedy decoding. Rows that produced the stop token get pad afterwards; sampling ends once
    every row has stopped (on every rank when `synced`: a ZeRO-3 sharded model needs all ranks in each forward)."""
    position_ids = (query_mask.cumsum(1) - 1).clamp(min=0)
    output = model(
        input_ids=queries, attention_mask=query_mask, position_ids=position_ids, use_cache=True, logits_to_keep=1
    )
    attention_mask, done, tokens = query_mask, torch.zeros(len(queries), dtype=torch.bool, device=queries.device), []
    for _ in range(response_length):
        logits = output.logits[:, -1].float()  # (N, V)
        if temperature == 0:
            sampled = logits.argmax(-1)
        else:
            probs = torch.softmax(logits / temperature, dim=-1)
            # a diverged policy (or a vanishing temperature) gives NaN: such rows sample uniformly, and the
            # update's non-finite guard skips them
            probs = torch.where(torch.isfinite(probs).all(-1, keepdim=True), probs, 1.0)
            sampled = torch.multinomial(probs, 1).squeeze(1)
        token = torch.where(done, pad_token_id, sampled)
        tokens.append(token)
        if stop_token_id is not None:
            done = done | (token == stop_token_id)
            running = (~done).sum()  # one host sync per token, as in HF generate
            if (all_reduce_sum(running) if synced else running).item() == 0:
                break
        if len(tokens) == response_length:
            break
        attention_mask = torch.cat([attention_mask, attention_mask.new_ones(len(queries), 1)], 1)
        position_ids = position_ids[:, -1:] + 1
        output = model(
            input_ids=token[:, None],
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=output.cache,
            use_cache=True,
        )
    return torch.stack(tokens, 1)  # (N, t <= response_length)


def rollout(model, queries, query_mask, args, temperature, pad_token_id, synced):
    """Step 1: a completion (N, response_length) for every query row, `local_rollout_forward_batch_size` rows per
    generate call, padded to response_length."""
    responses, chunk, length = [], args.local_rollout_forward_batch_size, args.response_length
    for i in range(0, len(queries), chunk):
        tokens = generate(
            model,
            queries[i : i + chunk],
            query_mask[i : i + chunk],
            length,
            temperature,
            args.stop_token_id,
            pad_token_id,
            synced,
        )
        responses.append(F.pad(tokens, (0, length - tokens.shape[1]), value=pad_token_id))
    return torch.cat(responses)


@dataclass
class RewardSource:
    """One term of the score: a reward function, or a reward model (with its own tokenizer when it re-encodes)."""

    name: str  # for the metric rewards/<name>
    flag: str  # for error messages: `--reward-fn module:function` or `--reward-model-path PATH`
    weight: float = 1.0
    fn: Any = None
    model: Any = None
    tokenizer: Any = None  # None: the reward model reads the policy's token ids (same vocabulary, a decoder)
    decoder: bool = True  # a decoder classifier, read at the last token; else an encoder, which pools on its own
    context: Optional[int] = None  # a reward model's positions (max_position_embeddings)


def score_completions(run, rows, query_responses, attention_mask, context_length, response_mask):
    """Step 4: score = sum_s weight_s * reward_s for each completion (k*B,), and each source's rewards by name.

    A reward function gets the prompts as the dataset holds them (text, or chat messages), the decoded completions,
    and as keyword lists aligned with them the dataset's other columns that it accepts. A reward model is read at
    the last real token: on the policy's token ids when it shares their vocabulary, else on prompt + completion
    rendered by its own tokenizer (render_for_reward)."""
    args, device = run.args, query_responses.device
    responses = query_responses[:, context_length:]
    prompts = [row[args.dataset_text_field] for row in rows]  # one row per completion
    columns = {name: [row.get(name) for row in rows] for name in rows[0] if name != args.dataset_text_field}
    completions = run.tokenizer.batch_decode(responses, skip_special_tokens=True)
    if any(source.tokenizer is not None for source in run.reward_sources):  # re-encoding adds eos where it stopped
        stopped = has_stop_token(responses, response_mask, args.stop_token_id).tolist()
    rewards = {}
    for source in run.reward_sources:
        if source.fn is not None:
            try:
                values = call_reward_fn(source, prompts, completions, columns)
            except RewardError as error:  # the run stops at the non-finite guard, on every rank together
                run.reward_error, values = str(error), [math.nan] * len(completions)
            rewards[source.name] = torch.tensor(values, dtype=torch.float, device=device)
            continue
        ids, mask, last_index = query_responses, attention_mask, context_length + response_mask.sum(1) - 1
        overflow = False
        if source.tokenizer is not None:  # re-encoded: left-padded for a decoder, so that the last token is last
            encoded = [render_for_reward(source.tokenizer, *row) for row in zip(prompts, completions, stopped)]
            ids, mask = (t.to(device) for t in pad_batch(encoded, source.tokenizer.pad_token_id, left=source.decoder))
            overflow = source.context is not None and ids.shape[1] > source.context  # beyond its positions
            if overflow:
                run.reward_error = (
                    f"{source.flag}: a prompt + completion re-encoded for the reward model is {ids.shape[1]} tokens, "
                    f"beyond its context of {source.context}; use a reward model with a longer context, or start a new "
                    "run with lower --max-prompt-length or --response-length"
                )
                # the forward still runs, cut to fit, so that a sharded model's collectives stay in step on every
                # rank; the guard then stops the run
                kept = slice(-source.context, None) if source.decoder else slice(0, source.context)
                ids, mask = ids[:, kept], mask[:, kept]
            last_index = torch.full((len(ids),), ids.shape[1] - 1, device=device)
        model, chunk = run.accelerator.unwrap_model(source.model), args.local_rollout_forward_batch_size
        with run.accelerator.autocast():
            values = [
                reward_model_values(source, model, ids[i : i + chunk], mask[i : i + chunk], last_index[i : i + chunk])
                for i in range(0, len(ids), chunk)
            ]
        rewards[source.name] = torch.cat(values) if not overflow else torch.full((len(ids),), math.nan, device=device)
    scores = sum(source.weight * rewards[source.name] for source in run.reward_sources)
    return scores, rewards  # (k*B,), {name: (k*B,)}


class RewardError(Exception):
    """A reward function raised, exited, or returned something other than one number per completion."""


def call_reward_fn(source, prompts, completions, columns):
    """fn(prompts, completions, **columns), passing only the columns it names (all of them to a **kwargs)."""
    parameters = inspect.signature(source.fn).parameters.values()
    if not any(p.kind == p.VAR_KEYWORD for p in parameters):
        columns = {name: values for name, values in columns.items() if name in {p.name for p in parameters}}
    try:
        scores = source.fn(prompts, completions, **columns)
    except (Exception, SystemExit) as error:  # sys.exit() inside a reward function must not end the run quietly
        raise RewardError(f"{source.flag} raised {type(error).__name__}: {first_line(error)}") from None
    if not isinstance(scores, (list, tuple, torch.Tensor, np.ndarray)) or len(scores) != len(completions):
        raise RewardError(f"{source.flag} must return {len(completions)} numbers, one per completion")
    try:
        return [float(score) for score in scores]
    except (TypeError, ValueError):
        raise RewardError(f"{source.flag} returned a value that is not a number") from None


def reward_model_values(source, model, ids, mask, last_index):
    """A decoder classifier's value at last_index (get_reward); an encoder's own forward, which pools its [CLS]."""
    if source.decoder:
        return get_reward(model, ids, mask, last_index)
    return model(input_ids=ids, attention_mask=mask).logits[:, 0].float()


def render_for_reward(tokenizer, prompt, completion, stopped):
    """prompt + completion as a reward model's own tokenizer writes them: its special tokens (a BOS, or [CLS] ...
    [SEP]), a chat prompt through its chat template with the completion as the assistant's turn, and its eos after
    a completion that stopped, since reward models trained on TRL-style data are read at that eos."""
    if isinstance(prompt, list):
        return chat_ids(tokenizer, prompt + [{"role": "assistant", "content": completion}], generation_prompt=False)
    ids, eos = tokenizer(prompt + completion)["input_ids"], tokenizer.eos_token_id
    return ids + [eos] if stopped and eos is not None and ids[-1] != eos else ids


def chat_ids(tokenizer, messages, generation_prompt):
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def pad_batch(sequences, pad_token_id, left=True):
    """Token lists -> (input_ids, attention_mask), padded to the longest: on the left, as generation wants, or on
    the right, as an encoder wants (its positions count from its first token)."""
    width = max(len(s) for s in sequences)
    input_ids = torch.full((len(sequences), width), pad_token_id or 0, dtype=torch.long)
    attention_mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for row, s in enumerate(sequences):
        columns = slice(width - len(s), width) if left else slice(0, len(s))
        input_ids[row, columns] = torch.tensor(s, dtype=torch.long)
        attention_mask[row, columns] = 1
    return input_ids, attention_mask


# ================================================================================================================
# the embedded toy task: nothing to download


def toy_tokenizer():
    """A character-level tokenizer built in memory: printable ASCII and newline, one token each, plus pad, eos and
    unk. Every completion decodes to readable text and encodes back to the same tokens."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    characters = [chr(c) for c in range(32, 127)] + ["\n"]
    special = ["<|pad|>", "<|endoftext|>", "<|unk|>"]
    vocab = {token: i for i, token in enumerate(characters + special)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<|unk|>"))  # no merges: one per character
    tokenizer.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        pad_token="<|pad|>",
        eos_token="<|endoftext|>",
        unk_token="<|unk|>",
        padding_side="left",
    )


def toy_policy(tokenizer, seed, hidden_size=64, intermediate_size=256):
    """A small GPT-NeoX (the Pythia architecture) with random weights: 2 layers, 4 heads."""
    from transformers import AutoModelForCausalLM, GPTNeoXConfig

    ids = dict(
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.eos_token_id
    )
    config = GPTNeoXConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=512,
        **ids,
    )
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config)


def toy_prompts():
    """256 short prompts: 16 openings x 16 subjects."""
    openings = (
        "Say something about|Describe|Write a line on|Tell me of|A word on|Sing of|Think about|Remember|"
        "Imagine|Praise|Name|Dream of|Talk about|Draw|Explain|Recall"
    ).split("|")
    subjects = (
        "the sea|a cat|the moon|old trees|rain|a city|bread|the wind|snow|a river|music|stars|a garden|fire|"
        "the road|winter"
    ).split("|")
    return [f"{opening} {subject}:" for opening in openings for subject in subjects]


def toy_reward(prompts, completions, response_length=53):
    """The toy task's reward: 10 x (lowercase vowels in the completion) / response_length, in [0, 10].

    Dividing by the fixed response length, not by the completion's own, keeps it from being gamed by stopping
    early. A random policy over the toy's 99 tokens scores about 10 x 5/99 = 0.5."""
    return [10.0 * sum(c in TOY_VOWELS for c in completion) / response_length for completion in completions]


# ================================================================================================================
# the loop


def main(args: Args):
    try:
        run = setup(args)  # validation, tokenizer, prompts, reward, models, accelerator, optimizer, resume
        train(run)
        save_final_model(run)
    finally:
        release_locks()


def train(run):
    """RLOO, one iteration per update: steps 1-10 in the algorithm's order. Shapes: B prompts per process,
    k = rloo_k completions each, P prompt tokens (left-padded), T response tokens."""
    args, accelerator, policy, tokenizer = run.args, run.accelerator, run.policy, run.tokenizer
    device, pad_token_id, micro = accelerator.device, tokenizer.pad_token_id, args.per_device_train_batch_size
    k, chunk = args.rloo_k, args.local_rollout_forward_batch_size  # chunk: completions per forward outside training
    for update in progress(run):
        lr = args.learning_rate * (1.0 - update / args.num_total_batches)  # linear decay to 0 over the run
        for group in run.optimizer.param_groups:
            group["lr"] = lr

        # ---- data: this rank's B prompts, repeated k times k-major (row i*B + j is sample i of prompt j)
        batch = batch_indices(args, len(run.prompts), update, accelerator.process_index)  # (B,) dataset rows
        queries, query_mask = pad_batch([run.prompts[i] for i in batch] * k, pad_token_id)
        queries, query_mask = queries.to(device), query_mask.to(device)  # (k*B, P)
        context_length = queries.shape[1]
        t0 = now()

        # ---- 1. rollout: sample k completions per prompt (ZeRO-3: with the full weights gathered once)
        policy.eval()  # no dropout anyway; eval lets generation use the KV cache under gradient checkpointing
        with torch.no_grad(), generation_context(run) as (model, synced):
            responses = rollout(model, queries, query_mask, args, args.temperature, pad_token_id, synced)
        # ---- 2. truncate after the stop token; then drop the columns where every completion had stopped
        responses, response_mask = truncate_response(responses, args.stop_token_id, pad_token_id)
        T = int(response_mask.sum(1).max())
        responses, response_mask = responses[:, :T], response_mask[:, :T]  # (k*B, T)
        query_responses = torch.cat([queries, responses], 1)  # (k*B, P + T)
        attention_mask = torch.cat([query_mask, response_mask.long()], 1)
        t1 = now()

        with torch.no_grad():
            # ---- 3. log-probs under the policy (the update's "old" log-probs) and under the reference; the
            # policy's in micro-batches of the training forward's size, so that with one epoch the first ratio is 1
            logprob_inputs = (query_responses, attention_mask, context_length, args.temperature)
            old_logprobs = batched_logprobs(policy, *logprob_inputs, micro)  # (k*B, T)
            with accelerator.autocast(), reference_model(run) as ref_policy:  # LoRA: the policy, adapters off
                ref_logprobs = batched_logprobs(ref_policy, *logprob_inputs, chunk)  # (k*B, T)
            # ---- 4. the score: the weighted sum of the reward sources (reward model, reward functions)
            rows = [run.rows[i] for i in batch] * k  # the dataset's row of each completion, k-major
            sequences = (query_responses, attention_mask, context_length, response_mask)
            scores, source_rewards = score_completions(run, rows, *sequences)  # (k*B,), each source's (k*B,)
        t2 = now()

        # ---- 5. missing-EOS penalty: completions that never produced the stop token lose missing_eos_penalty
        if args.missing_eos_penalty is not None:  # validate_args made sure a stop token is set
            missing_stop = ~has_stop_token(responses, response_mask, args.stop_token_id)  # (k*B,)
            scores = scores - args.missing_eos_penalty * missing_stop.float()
        raw_scores = scores  # what objective/scores logs: before normalization and clipping
        # ---- 6. normalize (optional, over the global batch) and always clip to [-c, c]
        if args.normalize_reward:
            scores = whiten(scores)
        clipped = (scores.abs() > args.reward_clip_range).sum()  # objective/scores_clipped_frac
        scores = scores.clamp(-args.reward_clip_range, args.reward_clip_range)

        # ---- 7. KL to the reference, per token, and 8. the leave-one-out advantages
        kl = torch.where(response_mask, old_logprobs - ref_logprobs, 0.0)  # (k*B, T)
        sequence_kl = kl.sum(1)  # (k*B,)
        if args.token_level_kl:
            advantages = token_level_advantages(scores, kl, response_mask, args.kl_coef, k, args.whiten_rewards)
            if args.normalize_advantage:
                advantages = torch.where(response_mask, whiten(advantages, response_mask), 0.0)  # (k*B, T)
        else:
            rewards = scores - args.kl_coef * sequence_kl  # the KL penalty is part of the sequence's reward
            if args.whiten_rewards:
                rewards = whiten(rewards, shift_mean=False)
            advantages = rloo_advantages(rewards, k)  # (k*B,)
            if args.normalize_advantage:
                advantages = whiten(advantages)

        # ---- non-finite guard: a NaN or inf anywhere in the rollout (a score, a log-prob) skips this update
        logprobs = torch.where(response_mask, old_logprobs + ref_logprobs, 0.0)  # non-finite if either one is
        finite = rollout_is_finite(run, update, raw_scores, advantages, logprobs)

        # ---- 9. the update: num_ppo_epochs passes, each over num_mini_batches shuffled mini-batches of
        # gradient_accumulation_steps micro-batches, one optimizer step per mini-batch
        policy.train()
        stats = dict.fromkeys(STAT_NAMES, 0.0)  # sums for the metrics, reduced over every rank in step 10
        for _ in range(args.num_ppo_epochs if finite else 0):  # no epochs at all when the guard skips the update
            permutation = torch.randperm(args.local_batch_size, device=device)
            for start in range(0, args.local_batch_size, micro):  # micro-batches; mini-batches are consecutive runs
                micro_batch = permutation[start : start + micro]
                inputs = (query_responses[micro_batch], attention_mask[micro_batch], context_length, args.temperature)
                old, mask = old_logprobs[micro_batch], response_mask[micro_batch]
                with accelerator.accumulate(policy):
                    new_logprobs, entropy = forward_logprobs(policy, *inputs, with_entropy=True)
                    loss, clipfrac = policy_loss(new_logprobs, old, advantages[micro_batch], mask, args.cliprange)
                    accelerator.backward(loss)  # under DeepSpeed this also clips and steps at the boundary
                    run.skipped_steps += optimizer_step(run)  # at the mini-batch's last micro-batch only
                add_stats(stats, loss, clipfrac, new_logprobs, old, entropy, mask, args.token_level_kl)
        run.skipped_steps += int(not finite)
        run.consecutive_skips = 0 if finite else run.consecutive_skips + 1
        t3 = now()

        # ---- 10. metrics (TRL's names), over real response tokens only, summed over every rank in one all-reduce
        sums = rollout_sums(run, responses, response_mask, old_logprobs, sequence_kl, raw_scores, scores) | {
            "clipped": clipped
        }
        sums |= {f"rewards/{name}": values.sum() for name, values in source_rewards.items()}  # before weighting
        metrics, stopping = update_metrics(run, update, stats | sums, lr, (t0, t1, t2, t3))
        log_update(run, update, metrics, query_responses[:4, :context_length], responses[:4], raw_scores[:4])
        end_of_update(run, update, stopping)
        run.previous_end = t3


# ================================================================================================================
# PLUMBING: setup, validation, data, checkpoints, metrics and reports. Skip this on a first read: nothing below
# changes what an update computes.


@dataclass
class Run:
    """What setup() hands the loop, and the counters the loop keeps across updates."""

    args: Args
    accelerator: Any
    tokenizer: Any
    prompts: list  # token-id lists, one per usable prompt
    rows: list  # the dataset's rows (every column), aligned with prompts
    policy: Any  # what trains: the model wrapped by accelerate (a DeepSpeed engine, DDP, or the model itself)
    ref_policy: Any
    optimizer: Any
    reward_sources: list  # RewardSource: the reward model first, then the reward functions
    eval_prompts: list = field(default_factory=list)  # held-out prompts (token ids) and their rows, for evaluate()
    eval_rows: list = field(default_factory=list)
    deepspeed: bool = False  # the policy is a DeepSpeed engine, which clips and steps inside backward()
    zero3: bool = False  # ... whose weights are sharded across ranks (ZeRO stage 3)
    start_update: int = 0
    history: list = field(default_factory=list)  # objective/scores of every update
    elapsed_before: float = 0.0  # seconds of training before a resume
    skipped_steps: int = 0
    consecutive_skips: int = 0
    problem: Optional[str] = None  # what the non-finite guard found last: "scores" or "log-probs"
    reward_error: Optional[str] = None  # a reward function's failure in this update
    write_error: Optional[str] = None  # the main process could not append to a file of the output directory
    last_saved: int = 0  # the update of the newest checkpoint this run wrote or resumed from
    rng_at_update_start: Any = None  # every generator's state as the update began
    warned_clipping: bool = False
    stop_signals: list = field(default_factory=list)  # SIGTERM / SIGINT received
    start_time: float = 0.0
    previous_end: float = 0.0
    phase_totals: dict = field(default_factory=lambda: dict.fromkeys(PHASES + ("tokens",), 0.0))


PHASES = ("generation", "scoring", "training", "other")
STAT_NAMES = ("loss", "clipfrac", "approxkl", "ratio", "ratio_sq", "entropy", "terms", "tokens")


def setup(args):
    """Everything the loop needs, checked in order of cost: flags, then tokenizer, prompts and reward functions,
    then the output directory and checkpoint, and only then the models."""
    from accelerate.utils import DistributedType

    warnings.filterwarnings("ignore", message=".*is deprecated. Please use `torch.distributed")  # DeepSpeed's calls
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    validate_args(args)
    if args.output_dir and main_rank():
        take_lock(args.output_dir, take=False)  # a live run writing there: say so before anything else
    policy_config = check_model_configs(args)
    tokenizer = load_tokenizer(args)
    prompts, rows, dropped = load_prompts(args, tokenizer, args.dataset_name, args.dataset_split, "--dataset-name")
    resume_dir, saved = find_checkpoint(args, world_size) if args.resume_from_checkpoint else (None, None)
    args = resolve_args(args, world_size, tokenizer, len(prompts), saved, dropped)
    if saved is not None:
        check_checkpoint_args(args, saved, resume_dir)
    evaluation = load_eval_prompts(args, tokenizer) if args.eval_steps else ([], [])  # prompts, rows
    longest_prompt = max(len(ids) for ids in prompts + evaluation[0])
    check_context_length(args, policy_config, longest_prompt, "policy")
    sources = [
        load_reward_fn(spec, rows[:2] + evaluation[1][:2], args.dataset_text_field) for spec in args.reward_fn or []
    ]
    if not sources and not args.reward_model_path:  # the toy task's reward
        toy = functools.partial(toy_reward, response_length=args.response_length)
        sources = [RewardSource("toy_reward", "the toy reward", fn=toy)]
    names = ["reward_model"] * bool(args.reward_model_path) + [source.name for source in sources]
    if len(set(names)) < len(names):  # each source's rewards and metrics go by its name
        raise ArgumentError(f"--reward-fn: two reward sources share a name ({', '.join(names)}); rename a function")
    prepare_output_dir(args, resume_dir)  # the lock: everything before it only reads and checks
    if not torch.cuda.is_available():
        torch.set_num_threads(args.cpu_threads)
    policy, ref_policy, reward_model = load_models(args, tokenizer, rows, longest_prompt)
    accelerator, zero3 = make_accelerator(args)
    trainable = [p for p in policy.parameters() if p.requires_grad]  # with LoRA, the adapters only
    optimizer = torch.optim.AdamW(trainable, lr=args.learning_rate, eps=1e-8, weight_decay=0.0)
    policy, optimizer = accelerator.prepare(policy, optimizer)
    ref_policy = prepare_frozen(ref_policy, accelerator) if ref_policy is not None else None
    if reward_model is not None:  # the reward model is the first source
        sources.insert(0, replace(reward_model, model=prepare_frozen(reward_model.model, accelerator)))
    for source, weight in zip(sources, args.reward_weights or [1.0] * len(sources)):
        source.weight = weight
    run = Run(args, accelerator, tokenizer, prompts, rows, policy, ref_policy, optimizer, sources, *evaluation)
    run.deepspeed, run.zero3 = accelerator.distributed_type == DistributedType.DEEPSPEED, zero3
    if args.report_to != "none":
        accelerator.init_trackers(args.exp_name, config=asdict(args))
    resume_or_seed(run, resume_dir, saved)
    if start_lineage(run, resume_dir):  # the first write into the output directory
        evaluate(run, run.start_update)  # owed by the run that wrote the checkpoint: it stopped before it
        if run.reward_error is not None:
            raise SystemExit(
                f"rloo.py: error: stopped in the evaluation after update {run.start_update}: "
                f"{run.reward_error} (checkpoint-{run.start_update} is unchanged)"
            )
    for signum in (signal.SIGTERM, signal.SIGINT):  # preemption: finish the update, checkpoint, exit
        signal.signal(signum, functools.partial(on_stop_signal, run))
    return run


def main_rank():
    """This process is the main one (rank 0), before the Accelerator exists: it alone writes files."""
    return int(os.environ.get("RANK", 0)) == 0


def on_stop_signal(run, number, frame):
    """The first SIGTERM or SIGINT (Ctrl-C) ends the run after the current update, with a checkpoint; a second
    one quits at once (the checkpoint being written, if any, stays a .tmp that a resume ignores)."""
    if run.stop_signals:
        print(f"rloo.py: stopped at once by a second {signal.Signals(number).name}", file=sys.stderr)
        release_locks()
        os._exit(128 + number)
    run.stop_signals.append(number)


# the lowest value each numeric flag may take (None, where allowed, means "not set")
FLAG_MINIMUMS = {
    "rloo_k": 2,
    **dict.fromkeys("response_length max_prompt_length per_device_train_batch_size lora_r".split(), 1),
    **dict.fromkeys("gradient_accumulation_steps num_mini_batches num_ppo_epochs save_steps".split(), 1),
    **dict.fromkeys("local_rollout_forward_batch_size save_total_limit total_episodes cpu_threads".split(), 1),
    **dict.fromkeys("num_eval_prompts".split(), 1),
    **dict.fromkeys("stop_token_id kl_coef max_grad_norm num_sample_generations eval_steps".split(), 0),
    **dict.fromkeys("eval_temperature missing_eos_penalty".split(), 0),
}
FLAG_POSITIVE = ("temperature", "cliprange", "reward_clip_range", "learning_rate", "num_train_epochs", "lora_alpha")


def validate_args(args):
    """Every check of the flags alone, before anything loads: a one-line error naming the flag and what is valid."""
    for name, lowest in FLAG_MINIMUMS.items():
        value = getattr(args, name)
        if value is not None and not lowest <= value < math.inf:  # the comparison also refuses NaN
            raise ArgumentError(f"--{name.replace('_', '-')} must be a finite number, at least {lowest} (got {value})")
    for name in FLAG_POSITIVE:
        value = getattr(args, name)
        if value is not None and not (0 < value < math.inf):
            raise ArgumentError(f"--{name.replace('_', '-')} must be a positive number (got {value})")
    sources = int(args.reward_model_path is not None) + len(args.reward_fn or []) or 1  # 1: the toy reward
    if args.reward_weights is not None and len(args.reward_weights) != sources:
        raise ArgumentError(
            f"--reward-weights: give one weight per reward source ({sources}: the reward model "
            "first, then each --reward-fn)"
        )
    if not all(math.isfinite(weight) for weight in args.reward_weights or []):
        raise ArgumentError(f"--reward-weights must be finite numbers (got {args.reward_weights})")
    if not 0 <= args.lora_dropout < 1:
        raise ArgumentError(f"--lora-dropout must be in [0, 1) (got {args.lora_dropout})")
    if args.merge_adapter and not args.use_peft:
        raise ArgumentError("--merge-adapter merges LoRA adapters: it needs --use-peft")
    if args.missing_eos_penalty is not None and args.stop_token is None and args.stop_token_id is None:
        raise ArgumentError("--missing-eos-penalty needs a stop token: add --stop-token eos or --stop-token-id")
    if args.report_to != "none" and importlib.util.find_spec(args.report_to) is None:
        raise ArgumentError(f"--report-to {args.report_to}: the package is not installed; pip install {args.report_to}")


def resolve_args(args, world_size, tokenizer, num_prompts, saved=None, dropped=0):
    """The one place where the parsed flags become the run's settings: defaults that depend on the run, the stop
    token, the batch sizes and the number of updates. Nothing else changes `args`."""
    toy = args.sft_model_path is None
    run_name = args.run_name or f"{args.exp_name}__{args.seed}__{int(time.time())}"
    if args.stop_token == "eos" and tokenizer.eos_token_id is None:
        raise ArgumentError("--stop-token eos: the policy's tokenizer has no eos token; give --stop-token-id")
    if args.stop_token_id is not None and args.stop_token_id >= len(tokenizer):
        raise ArgumentError(
            f"--stop-token-id {args.stop_token_id} is not in the policy's vocabulary "
            f"({len(tokenizer)} tokens); a completion would never stop"
        )
    if not 0 <= args.seed < 2**32 - 100003 * (world_size - 1):
        raise ArgumentError(f"--seed must be in [0, 2**32 - 100003 x (processes - 1)) (got {args.seed})")
    # a resumed run keeps the checkpoint's length, unless the flag says otherwise (and then it must agree)
    total_episodes = saved["args"]["total_episodes"] if saved and args.total_episodes is None else args.total_episodes
    local_batch_size = args.per_device_train_batch_size * args.gradient_accumulation_steps * args.num_mini_batches
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    args = replace(
        args,
        run_name=run_name,
        output_dir=args.output_dir or os.path.join("runs", run_name),
        learning_rate=args.learning_rate or (1e-3 if toy else 5e-5),
        stop_token_id=tokenizer.eos_token_id if args.stop_token == "eos" else args.stop_token_id,
        total_episodes=int(args.num_train_epochs * num_prompts) if total_episodes is None else total_episodes,
        cpu_threads=args.cpu_threads or max(1, cores // int(os.environ.get("LOCAL_WORLD_SIZE", 1))),
        world_size=world_size,
        local_batch_size=local_batch_size,
        batch_size=local_batch_size * world_size,
        local_dataloader_batch_size=local_batch_size // args.rloo_k,
    )
    args = replace(args, num_total_batches=math.ceil(args.total_episodes / args.batch_size))
    if local_batch_size % args.rloo_k:
        raise ArgumentError(
            f"the per-process batch (--per-device-train-batch-size x --gradient-accumulation-steps x "
            f"--num-mini-batches = {local_batch_size}) must be divisible by --rloo-k {args.rloo_k}"
        )
    needed = args.local_dataloader_batch_size * world_size
    if num_prompts < needed:
        left_out = f" ({dropped} more were longer than --max-prompt-length {args.max_prompt_length})" if dropped else ""
        raise ArgumentError(
            f"--dataset-name: {num_prompts} prompts{left_out} are fewer than one update needs "
            f"({needed}); lower --per-device-train-batch-size"
        )
    if args.total_episodes < args.batch_size:
        raise ArgumentError(
            f"--total-episodes {args.total_episodes} is less than one update "
            f"({args.batch_size} completions on {world_size} processes)"
        )
    return args


def load_reward_fn(spec, rows, text_field):
    """Import `module:function` and try it once on two prompts (with their columns), so that a broken function
    fails before any model is loaded. The module is looked up on sys.path and in the current directory."""
    module_name, _, function_name = spec.partition(":")
    if os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())
    try:
        fn = getattr(importlib.import_module(module_name), function_name)
    except Exception as error:  # not found, or the module itself failed (a SyntaxError, an error at import)
        raise ArgumentError(f"--reward-fn {spec}: cannot import it ({error}); give module:function") from None
    source = RewardSource(function_name, f"--reward-fn {spec}", fn=fn)
    prompts = [row[text_field] for row in rows]
    columns = {name: [row.get(name) for row in rows] for name in rows[0] if name != text_field}
    try:
        scores = call_reward_fn(source, prompts, ["hello", ""][: len(rows)], columns)
    except RewardError as error:
        raise ArgumentError(f"{error} (tried on two prompts at start-up)") from None
    if any(math.isnan(score) for score in scores):
        raise ArgumentError(f"--reward-fn {spec} returned NaN for a test completion; it must return real numbers")
    return source


def first_line(error):
    lines = str(error).strip().splitlines()
    return lines[0][:120] if lines else type(error).__name__


def load_pretrained(path, flag, model_class, trust_remote_code, **kwargs):
    """from_pretrained with an error naming the flag when nothing loadable is there."""
    try:
        return model_class.from_pretrained(path, trust_remote_code=trust_remote_code, **kwargs)
    except (OSError, ValueError) as error:
        offline = os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false")
        hub = "the hub is off (HF_HUB_OFFLINE)" if offline else "a hub id"
        where = "a local directory" if os.path.isdir(path) else hub
        raise ArgumentError(
            f"{flag} {path}: no model could be loaded ({where}: {first_line(error)}); "
            "offline runs need a local directory written by save_pretrained"
        ) from None


def check_model_configs(args):
    """Configs only: a wrong model path fails here, before any weights are read. Returns the policy's config
    (None for the toy policy)."""
    from transformers import AutoConfig

    policy_config = None
    if args.sft_model_path is not None:
        policy_config = load_pretrained(args.sft_model_path, "--sft-model-path", AutoConfig, args.trust_remote_code)
    if args.reward_model_path:
        config = load_pretrained(args.reward_model_path, "--reward-model-path", AutoConfig, args.trust_remote_code)
        if config.num_labels != 1:
            raise ArgumentError(
                f"--reward-model-path {args.reward_model_path}: the reward model has "
                f"{config.num_labels} output labels; it needs exactly 1"
            )
    return policy_config


def check_context_length(args, config, longest_prompt, model="policy"):
    """The longest prompt and a whole completion must fit a model's context (position embeddings)."""
    context = getattr(config, "max_position_embeddings", None) if config else 512  # the toy's
    if context is not None and longest_prompt + args.response_length > context:
        raise ArgumentError(
            f"--response-length {args.response_length} after the longest prompt ({longest_prompt} "
            f"tokens) is beyond the {model}'s context of {context} tokens; lower --response-length or "
            "--max-prompt-length"
        )


def load_tokenizer(args):
    """The policy's tokenizer, left-padding (generation appends on the right)."""
    from transformers import AutoTokenizer

    if args.sft_model_path is None:
        return toy_tokenizer()
    tokenizer = load_pretrained(args.sft_model_path, "--sft-model-path", AutoTokenizer, args.trust_remote_code)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token  # fine here: masks come from positions, never from the pad id
    return tokenizer


def load_prompts(args, tokenizer, path, split, flag):
    """The dataset's usable prompts: (token-id lists, rows with every column, how many were left out).

    Text is encoded with the tokenizer's defaults, so a BOS that it adds stays; chat messages go through its chat
    template, whose own special tokens count (no second BOS). Prompts over max_prompt_length tokens are left out."""
    text_field = args.dataset_text_field
    if path is None:
        rows = [{text_field: text} for text in toy_prompts()]
        places = [f"toy prompt {n}" for n in range(len(rows))]
    elif path.endswith(".jsonl"):  # read directly: no need for the datasets library (and its memory) here
        rows, places = read_jsonl(path, text_field, flag)
    else:
        rows = load_dataset_rows(path, split, text_field, flag)
        places = [f"row {n}" for n in range(len(rows))]
    if not rows:
        raise ArgumentError(f"{flag} {path}: the dataset is empty")
    prompts, kept = [], []
    for row, place in zip(rows, places):
        prompt = row[text_field]
        check_prompt(prompt, f"{flag} {path}, {place}: field {text_field!r}")
        ids = chat_prompt_ids(tokenizer, prompt, place) if isinstance(prompt, list) else tokenizer(prompt)["input_ids"]
        if 0 < len(ids) <= args.max_prompt_length:
            prompts.append(list(ids))
            kept.append(row)
    dropped = len(rows) - len(kept)
    if not prompts:
        raise ArgumentError(
            f"--max-prompt-length {args.max_prompt_length}: all {len(rows)} prompts of {flag} are "
            "longer (or empty); raise it"
        )
    if dropped and main_rank():
        print(
            f"rloo.py: {dropped} of {len(rows)} prompts of {flag} are longer than --max-prompt-length "
            f"{args.max_prompt_length} tokens (or empty) and are left out",
            file=sys.stderr,
        )
    return prompts, kept, dropped


def read_jsonl(path, text_field, flag):
    """The rows of a JSON-lines file and their places ("line 7"); a bad line is a one-line error naming it."""
    try:
        with open(path, "rb") as f:
            lines = f.read().split(b"\n")
    except OSError as error:
        raise ArgumentError(f"{flag} {path}: cannot read it ({error.strerror})") from None
    rows, places = [], []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{flag} {path}, line {number}"
        try:
            row = json.loads(line.decode("utf-8"))
        except UnicodeDecodeError:
            raise ArgumentError(f"{where}: not UTF-8 text") from None
        except json.JSONDecodeError as error:
            raise ArgumentError(f"{where}: not valid JSON ({error.msg} at column {error.colno})") from None
        if not isinstance(row, dict):
            raise ArgumentError(f"{where}: {json_kind(row)}, not a JSON object with a {text_field!r} field")
        if text_field not in row:
            raise ArgumentError(
                f"--dataset-text-field {text_field}: {path}, line {number} has no such field "
                f"(its fields: {', '.join(row) or 'none'})"
            )
        rows.append(row)
        places.append(f"line {number}")
    return rows, places


def load_dataset_rows(path, split, text_field, flag):
    """The rows of a hub dataset or of a directory written by save_to_disk."""
    import datasets

    try:
        if os.path.isdir(path) and (
            os.path.exists(os.path.join(path, "dataset_info.json"))
            or os.path.exists(os.path.join(path, "dataset_dict.json"))
        ):
            dataset = datasets.load_from_disk(path)
        else:
            dataset = datasets.load_dataset(path, split=split)
        if isinstance(dataset, datasets.DatasetDict):
            dataset = dataset[split]
    except Exception as error:  # datasets raises many kinds; all mean the same to the user
        raise ArgumentError(f"{flag} {path}: cannot load split {split!r} ({first_line(error)})") from None
    if text_field not in dataset.column_names:
        raise ArgumentError(
            f"--dataset-text-field {text_field}: no such field in {path} (fields: {', '.join(dataset.column_names)})"
        )
    return dataset.to_list()


def json_kind(value):
    names = {type(None): "null", bool: "a boolean", int: "a number", float: "a number", str: "a string"}
    return names.get(type(value), "a JSON array" if isinstance(value, list) else "a JSON object")


def check_prompt(prompt, where):
    """A prompt is a string, or a non-empty list of chat messages ({"role": ..., "content": "..."}), in Unicode."""
    messages = isinstance(prompt, list) and prompt and all(isinstance(m, dict) and "role" in m for m in prompt)
    texts = [m.get("content") for m in prompt] if messages else [prompt]
    if not all(isinstance(text, str) for text in texts):
        kind = json_kind(prompt) if not messages else "a list of messages whose content is not always a string"
        raise ArgumentError(
            f'{where} is {kind}; a prompt is a string or a list of chat messages ({{"role": ..., "content": "..."}})'
        )
    for text in texts:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            raise ArgumentError(f"{where} holds a lone surrogate ({text!r:.40}), which is not valid Unicode") from None


def chat_prompt_ids(tokenizer, messages, place):
    """Chat messages rendered by the policy's chat template, ending with the assistant's turn to speak."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise ArgumentError(
            "--dataset-text-field: the prompts are chat messages, but the policy's tokenizer has no "
            "chat template; give plain-text prompts or a model whose tokenizer has one"
        )
    try:
        return chat_ids(tokenizer, messages, generation_prompt=True)
    except Exception as error:  # jinja's TemplateError, or raise_exception() inside the template
        raise ArgumentError(
            f"--dataset-text-field: the policy's chat template refused the messages of {place} "
            f"({first_line(error)}); change those messages (e.g. fold a system message into "
            "the first user message)"
        ) from None


def load_models(args, tokenizer, rows, longest_prompt):
    """Policy, reference and the reward model (a RewardSource, or None). They load before the Accelerator, so
    every rank gets the same full weights, which the DeepSpeed engines then shard (after Accelerator() under a
    ZeRO-3 plugin, from_pretrained would shard while loading). Every model loads in float32, whatever the
    checkpoint's dtype: the optimizer steps float32 weights (stepping bf16 weights directly would round most small
    updates away), and the reference must compute exactly what the policy does before its first step. Mixed
    precision is accelerate's autocast (or DeepSpeed's bf16, with float32 master weights)."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    policy = load_policy(args, tokenizer)
    ref_policy = None if args.use_peft else load_policy(args, tokenizer)  # LoRA: the policy, its adapters off
    if args.use_peft:
        policy = add_lora(args, policy)
    reward = None
    if args.reward_model_path:
        load = functools.partial(load_pretrained, args.reward_model_path, "--reward-model-path")
        model = load(AutoModelForSequenceClassification, args.trust_remote_code, dtype=torch.float32)
        reward_tokenizer = load(AutoTokenizer, args.trust_remote_code)
        # decoder classifiers (GPT-2, Llama, Qwen2, GPT-NeoX...) have a `score` head read at the last token;
        # encoders (BERT, RoBERTa, DeBERTa...) pool their first token through their own forward
        decoder = hasattr(model, "score")
        if decoder and reward_tokenizer.get_vocab() == tokenizer.get_vocab():
            reward_tokenizer = None  # the same vocabulary: score the policy's token ids directly
        flag = f"--reward-model-path {args.reward_model_path}"
        context = getattr(model.config, "max_position_embeddings", None)  # re-encoded inputs are checked as scored
        reward = RewardSource("reward_model", flag, 1.0, None, model, reward_tokenizer, decoder, context)
        if reward_tokenizer is None:  # it reads the policy's tokens: their lengths are known now
            check_context_length(args, model.config, longest_prompt, "reward model")
        check_reward_model(reward, tokenizer, rows[0][args.dataset_text_field])
    for model in (policy, ref_policy, reward and reward.model):
        if model is not None:
            disable_dropout(model)  # the log-probs of the rollout and of the update must come from the same function
    if args.gradient_checkpointing:
        policy.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        if args.use_peft:
            policy.enable_input_require_grads()  # the frozen embeddings' output must carry gradients through
    return policy, ref_policy, reward


def load_policy(args, tokenizer):
    """The policy's initial weights in float32: the toy's (from the seed), or --sft-model-path's."""
    from transformers import AutoModelForCausalLM

    if args.sft_model_path is None:
        return toy_policy(tokenizer, args.seed)  # the same seed: the same initial weights
    return load_pretrained(
        args.sft_model_path, "--sft-model-path", AutoModelForCausalLM, args.trust_remote_code, dtype=torch.float32
    )


def add_lora(args, policy):
    """LoRA adapters on the policy (peft): only they train; B starts at 0, so before the first step the policy
    computes exactly what its base does."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=args.lora_r,
        lora_alpha=args.lora_alpha,
        lora_dropout=args.lora_dropout,
        target_modules=args.lora_target_modules or "all-linear",
        task_type=args.lora_task_type,
    )
    torch.manual_seed(args.seed)  # the adapters' initial weights: the same on every rank and in every run
    try:
        return get_peft_model(policy, config)
    except ValueError as error:
        raise ArgumentError(
            f"--lora-target-modules {' '.join(args.lora_target_modules or ['all-linear'])}: {first_line(error)}"
        ) from None


def check_reward_model(source, tokenizer, prompt):
    """Score one short completion of the first prompt, as the run will: what cannot be scored fails here."""
    render_tokenizer = source.tokenizer or tokenizer
    if isinstance(prompt, list) and getattr(render_tokenizer, "chat_template", None) is None:
        raise ArgumentError(
            f"{source.flag}: the prompts are chat messages, but the reward model's tokenizer has no "
            "chat template to render them with"
        )
    try:
        ids = render_for_reward(render_tokenizer, prompt, " hello", stopped=True)
        ids, mask = pad_batch([ids], render_tokenizer.pad_token_id)
        with torch.no_grad():
            value = reward_model_values(source, source.model, ids, mask, torch.tensor([ids.shape[1] - 1]))
        assert value.shape == (1,), f"one value per sequence, got shape {tuple(value.shape)}"
    except Exception as error:
        raise ArgumentError(
            f"{source.flag}: rloo.py cannot score with this model ({first_line(error)}); it needs "
            "a sequence classifier with one label (AutoModelForSequenceClassification)"
        ) from None


def disable_dropout(model):
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0


def make_accelerator(args):
    """The Accelerator, with gloo where there is no CUDA so that DeepSpeed and DDP run on CPUs too, and the
    DeepSpeed config completed from the flags. Returns (accelerator, zero3)."""
    from accelerate import Accelerator
    from accelerate.utils import DistributedType, InitProcessGroupKwargs

    cpu_group = args.world_size > 1 and not torch.cuda.is_available()
    if cpu_group and os.environ.get("ACCELERATE_USE_DEEPSPEED", "false") != "true":
        # `accelerate launch --multi_gpu` on a machine without CUDA: unless told it is on CPUs, accelerate sees no
        # distributed setup, never wraps the policy in DDP, and each rank would train its own copy
        os.environ["ACCELERATE_USE_CPU"] = "true"
    accelerator = Accelerator(
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        log_with=None if args.report_to == "none" else args.report_to,
        project_dir=args.output_dir,
        kwargs_handlers=[InitProcessGroupKwargs(backend="gloo")] if cpu_group else [],
    )
    if accelerator.num_processes != args.world_size or (cpu_group and accelerator.distributed_type == "NO"):
        raise ArgumentError(
            f"{args.world_size} processes were launched, but accelerate set up "
            f"{accelerator.distributed_type} with {accelerator.num_processes}: the ranks would train "
            "apart; launch with --multi_gpu (and ACCELERATE_USE_CPU=true without CUDA) or a DeepSpeed config"
        )
    if accelerator.distributed_type != DistributedType.DEEPSPEED:
        return accelerator, False
    ds_config = accelerator.state.deepspeed_plugin.deepspeed_config
    ds_config["train_micro_batch_size_per_gpu"] = args.per_device_train_batch_size
    ds_config["gradient_accumulation_steps"] = args.gradient_accumulation_steps
    ds_config["train_batch_size"] = (
        args.per_device_train_batch_size * args.gradient_accumulation_steps * args.world_size
    )
    ds_config["gradient_clipping"] = args.max_grad_norm
    ds_config["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = True  # a full state dict to save
    return accelerator, ds_config["zero_optimization"]["stage"] == 3


def prepare_frozen(model, accelerator):
    """The reference and reward models take no gradient. Under ZeRO-3 each becomes a DeepSpeed engine without an
    optimizer, sharded across ranks like the policy; otherwise a plain copy on each device."""
    from accelerate.utils import DistributedType

    model.eval().requires_grad_(False)
    if accelerator.distributed_type != DistributedType.DEEPSPEED:
        return model.to(accelerator.device)
    import deepspeed

    ds_config = accelerator.state.deepspeed_plugin.deepspeed_config
    config = {k: v for k, v in ds_config.items() if k not in ("optimizer", "scheduler")}
    if config["zero_optimization"]["stage"] != 3:
        config["zero_optimization"] = {"stage": 0}  # stages 1-2 shard optimizer state only: nothing to shard here
    engine, *_ = deepspeed.initialize(model=model, config=config)
    engine.eval()
    return engine


def prepare_output_dir(args, resume_dir):
    """Before anything is written: --output-dir is a writable directory that no other live run is writing (a lock
    holds the pid), a new run does not overwrite another one (unless --overwrite-output-dir), and resuming from
    another directory's checkpoint needs an empty --output-dir. start_lineage writes, once the models loaded."""
    out = args.output_dir
    if os.path.isfile(out):
        raise ArgumentError(f"--output-dir {out} is a file, not a directory; choose another --output-dir")
    holds_run = bool(checkpoint_dirs(out)) or bool(read_metrics_lines(os.path.join(out, "metrics.jsonl")))
    own = resume_dir is not None and os.path.realpath(os.path.dirname(resume_dir)) == os.path.realpath(out)
    if main_rank() and holds_run and resume_dir is None and not args.overwrite_output_dir:
        raise ArgumentError(
            f"--output-dir {out} already holds a run; continue it with --resume-from-checkpoint "
            "latest, start over with --overwrite-output-dir, or choose another --output-dir"
        )
    if main_rank() and holds_run and resume_dir is not None and not own:
        raise ArgumentError(
            f"--resume-from-checkpoint {resume_dir} belongs to another run, and --output-dir {out} "
            "already holds one; resume into an empty --output-dir, or from a checkpoint of its own"
        )
    try:
        os.makedirs(out, exist_ok=True)
        probe = os.path.join(out, f".write_test.{socket.gethostname()}.{os.getpid()}")  # every process, at once
        open(probe, "w").close()
        os.remove(probe)
    except OSError as error:
        raise ArgumentError(f"--output-dir {out}: cannot write there ({error.strerror})") from None
    if main_rank():
        take_lock(out)


def start_lineage(run, resume_dir):
    """The output directory as this run's lineage, once the checkpoint loaded (main process; then every rank
    waits). Resuming from checkpoint N abandons whatever was written after N: moved aside into `abandoned-<time>/`,
    not deleted. --overwrite-output-dir deletes another run's metrics, evaluations and checkpoints. Returns, on
    every rank, whether the evaluation after update N is owed: the run stopped before it (a signal, a reward
    function that failed in it), so the resume runs it first."""
    out, update, owed = run.args.output_dir, run.start_update, False
    if run.accelerator.is_main_process:
        source = os.path.dirname(resume_dir) if resume_dir else out  # another directory's: its metrics so far
        metrics = read_metrics_lines(os.path.join(source, "metrics.jsonl")) if resume_dir else []
        evaluations = read_metrics_lines(os.path.join(source, "eval_completions.jsonl")) if resume_dir else []
        if resume_dir is None:  # a new run: what is there belongs to a run it overwrites
            for path in glob.glob(os.path.join(out, "checkpoint-*")):
                shutil.rmtree(path)
        elif source == out or os.path.realpath(source) == os.path.realpath(out):
            abandon_after(out, update, metrics, evaluations)
        evaluated = any(r["update"] == update and "eval/scores" in r for r in metrics)
        owed = eval_due(run.args, update) and not evaluated
        # completions of an owed evaluation were written by one cut short before its metrics record: drop them
        evaluations = [r for r in evaluations if not (owed and r["update"] == update)]
        for name, records in [("metrics.jsonl", metrics), ("eval_completions.jsonl", evaluations)]:
            path = os.path.join(out, name)
            with open(path + ".tmp", "w") as f:  # the updates the checkpoint holds, no more; replaced whole
                f.writelines(json.dumps(r) + "\n" for r in records if r["update"] <= update)
            os.replace(path + ".tmp", path)
    run.accelerator.wait_for_everyone()
    return agree(owed, run.accelerator.device)


def abandon_after(out, update, metrics, evaluations):
    """Move what a run wrote after checkpoint `update` (newer checkpoints, their metrics and evaluations, a final
    model) aside."""
    later = [d for d in checkpoint_dirs(out) if checkpoint_number(d) > update]
    final = [p for p in glob.glob(os.path.join(out, "*")) if os.path.basename(p) in FINAL_MODEL_FILES]
    later_metrics = [m for m in metrics if m["update"] > update]
    if not (later or later_metrics):
        return
    aside = os.path.join(out, f"abandoned-{int(time.time())}")
    os.makedirs(aside)
    for path in later + final:
        shutil.move(path, aside)
    for name, records in [("metrics.jsonl", later_metrics), ("eval_completions.jsonl", evaluations)]:
        with open(os.path.join(aside, name), "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in records if r["update"] > update)
    names = ", ".join(os.path.basename(p) for p in later) or "no checkpoint"
    print(
        f"rloo.py: resuming from checkpoint-{update} abandons what was written after it ({names}, "
        f"{len(later_metrics)} metrics lines{', the final model' if final else ''}): moved to {aside}",
        file=sys.stderr,
    )


# what save_final_model writes into --output-dir (besides the tokenizer's files)
FINAL_MODEL_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "model.safetensors.index.json",
    "adapter_config.json",
    "adapter_model.safetensors",
    "merged",
)


def read_metrics_lines(path):
    """metrics.jsonl's records; a last line cut short (a crash or a full disk while appending) is dropped."""
    lines = read_text(path).splitlines() if os.path.exists(path) else []
    records = []
    for number, line in enumerate(lines, 1):
        try:
            records.append(json.loads(line))
        except ValueError:
            if number < len(lines):
                raise ArgumentError(f"{path}, line {number}: not a metrics record; repair or remove it") from None
    return records


LOCKS = []  # the lock files this process holds, released when main() ends


def take_lock(out, take=True):
    """`.lock` in the output directory names the host and pid of the run writing it: while that process lives,
    another run into the directory is refused (a resume started while a stopping run still saves, say). A lock
    whose process is gone is stale and removed. With take=False, only check."""
    path, me = os.path.join(out, ".lock"), f"{socket.gethostname()} {os.getpid()}"
    if os.path.exists(path):
        host, _, pid = read_text(path).partition(" ")
        pid = int(pid) if pid.isdigit() else 0
        if host != socket.gethostname() or (pid != os.getpid() and process_alive(pid)):
            raise ArgumentError(
                f"--output-dir {out}: another run (pid {pid} on {host}) is writing it; wait for it "
                f"to end, or stop it (if it is gone, delete {path})"
            )
        os.remove(path)
    if take:
        try:
            with open(path, "x") as f:  # fails if another run took it since
                f.write(me)
        except FileExistsError:
            raise ArgumentError(f"--output-dir {out}: another run started writing it just now") from None
        LOCKS.append((path, me))


def read_text(path):
    with open(path) as f:
        return f.read()


def process_alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return pid > 0


def release_locks():
    while LOCKS:
        path, me = LOCKS.pop()
        with contextlib.suppress(OSError):
            if read_text(path) == me:
                os.remove(path)


def find_checkpoint(args, world_size):
    """The checkpoint to resume from and its trainer_state.json. `latest` is the newest intact one (a damaged one
    is skipped with a warning); a checkpoint named explicitly must be intact."""
    resume_dir = args.resume_from_checkpoint
    if resume_dir == "latest" and not args.output_dir:
        raise ArgumentError("--resume-from-checkpoint latest looks in --output-dir: give --output-dir")
    if resume_dir == "latest":
        for resume_dir in reversed(checkpoint_dirs(args.output_dir)):
            saved, problem = read_checkpoint(resume_dir)
            if problem is None:
                break
            if main_rank():
                print(f"rloo.py: warning: {resume_dir} is damaged ({problem}); trying an older one", file=sys.stderr)
        else:
            raise ArgumentError(
                f"--resume-from-checkpoint latest: no intact checkpoint in {args.output_dir}; start "
                "over with --overwrite-output-dir"
            )
    else:
        resume_dir = os.path.normpath(resume_dir)  # a trailing slash must not make it another directory's
        if not os.path.exists(os.path.join(resume_dir, "trainer_state.json")):
            raise ArgumentError(f"--resume-from-checkpoint {resume_dir}: not a checkpoint directory written by rloo.py")
        saved, problem = read_checkpoint(resume_dir)
        if problem is not None:
            raise ArgumentError(
                f"--resume-from-checkpoint {resume_dir} is damaged ({problem}); resume from another checkpoint"
            )
    if saved["world_size"] != world_size:
        raise ArgumentError(
            f"--resume-from-checkpoint {resume_dir}: written by {saved['world_size']} processes, "
            f"this run has {world_size}; launch with --num_processes {saved['world_size']}"
        )
    return resume_dir, saved


def read_checkpoint(path):
    """(trainer_state, None), or (None, what is wrong with the checkpoint). trainer_state.json lists every file
    with its size: each must be there whole; the RNG states and safetensors headers must also read."""
    try:
        with open(os.path.join(path, "trainer_state.json")) as f:
            saved = json.load(f)
        files, world_size = saved["files"], saved["world_size"]
        [saved[key] for key in ("update", "args", "score_history", "elapsed", "skipped_steps", "consecutive_skips")]
    except (OSError, ValueError, KeyError, TypeError):
        return None, "trainer_state.json is missing or unreadable"
    for name in [f"random_states_{rank}.pkl" for rank in range(world_size)] + list(files):
        full = os.path.join(path, name)
        if name not in files or not os.path.isfile(full):
            return None, f"{name} is missing"
        if os.path.getsize(full) != files[name]:
            return None, f"{name} has {os.path.getsize(full)} bytes, not {files[name]}"
        try:
            if name.endswith(".pkl"):
                torch.load(full, weights_only=False)  # every rank's RNG state: small, and a resume needs it exact
            elif name.endswith(".safetensors"):
                with open(full, "rb") as f:
                    json.loads(f.read(int.from_bytes(f.read(8), "little")))
        except Exception:
            return None, f"{name} is unreadable"
    return saved, None


# flags that set the prompts, their order, the batch and the run's length: a resume must keep them. The others
# (the loss's coefficients, output, logging, saving) may change on purpose.
RESUME_FIXED = (
    "rloo_k per_device_train_batch_size gradient_accumulation_steps num_mini_batches total_episodes response_length "
    "seed sft_model_path dataset_name dataset_split dataset_text_field max_prompt_length token_level_kl use_peft "
    "lora_r lora_alpha lora_target_modules lora_task_type"
).split()


def check_checkpoint_args(args, saved, resume_dir):
    for name in RESUME_FIXED:
        if saved["args"][name] != getattr(args, name):
            flag = "--" + name.replace("_", "-")
            raise ArgumentError(
                f"--resume-from-checkpoint {resume_dir}: written with {flag} {saved['args'][name]}, "
                f"this run has {getattr(args, name)}; use the same {flag}"
            )


def checkpoint_dirs(output_dir):
    """Complete checkpoints, oldest first: `checkpoint-<update>` directories with a trainer_state.json (a
    checkpoint is written as `*.tmp` and renamed when complete)."""
    found = glob.glob(os.path.join(output_dir, "checkpoint-*"))
    found = [d for d in found if re.fullmatch(r"checkpoint-\d+", os.path.basename(d))]
    return sorted((d for d in found if os.path.exists(os.path.join(d, "trainer_state.json"))), key=checkpoint_number)


def checkpoint_number(path):
    return int(os.path.basename(os.path.normpath(path)).split("-")[1])


def resume_or_seed(run, resume_dir, saved):
    """Resume: weights, optimizer and every rank's RNG come back; data order and learning rate follow from the
    update counter. A new run seeds each rank."""
    accelerator, args = run.accelerator, run.args
    # every rank must have found the same checkpoint: on several machines, --output-dir must be shared
    found = accelerator.gather(torch.tensor([saved["update"] if saved else -1], device=accelerator.device))
    if found.min() != found.max():
        raise ArgumentError(
            f"--resume-from-checkpoint: the processes found different checkpoints (updates "
            f"{sorted(set(found.tolist()))}); --output-dir must be on a filesystem every node shares"
        )
    if resume_dir is not None:
        try:
            accelerator.load_state(resume_dir)
        except Exception as error:
            raise ArgumentError(
                f"--resume-from-checkpoint {resume_dir}: cannot load it ({first_line(error)})"
            ) from None
        run.start_update, run.history, run.elapsed_before = saved["update"], saved["score_history"], saved["elapsed"]
        run.last_saved, run.skipped_steps = saved["update"], saved["skipped_steps"]
        run.consecutive_skips = saved["consecutive_skips"]
        if accelerator.is_main_process:
            print(f"resumed from {resume_dir} at update {run.start_update}")
    else:
        # each (seed, rank) its own stream, far from the next seed's: seed 42 rank 1 is not seed 43 rank 0; a fixed
        # seed and world size give the same run (python's and numpy's generators too, for reward functions)
        set_rng_states(rank_seed(args.seed, accelerator.process_index))


def rank_seed(seed, rank):
    return seed + 100003 * rank


def rng_states():
    """Every random generator's state: python's, numpy's, torch's (and CUDA's)."""
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    return random.getstate(), np.random.get_state(), torch.get_rng_state(), cuda


def set_rng_states(states):
    """Restore rng_states(), or seed every generator with one integer."""
    if isinstance(states, int):
        random.seed(states)
        np.random.seed(states)
        torch.manual_seed(states)
        return
    random.setstate(states[0])
    np.random.set_state(states[1])
    torch.set_rng_state(states[2])
    if states[3] is not None:
        torch.cuda.set_rng_state_all(states[3])


def batch_indices(args, num_prompts, update, rank):
    """This rank's B prompt indices for the update. One shuffled order per pass over the prompts, the same on
    every rank; each rank takes its slice."""
    B = args.local_dataloader_batch_size
    batches_per_pass = num_prompts // (B * args.world_size)
    generator = torch.Generator().manual_seed(args.seed * 100003 + update // batches_per_pass)  # one per (seed, pass)
    order = torch.randperm(num_prompts, generator=generator)
    start = ((update % batches_per_pass) * args.world_size + rank) * B
    return order[start : start + B].tolist()


@contextlib.contextmanager
def generation_context(run):
    """The model to sample from, and whether sampling must stay in step across ranks. Under ZeRO-3 with
    ds3_gather_for_generation, the full weights are gathered once for the whole rollout and ZeRO-3's hooks come
    off meanwhile: they would release each weight after its use and gather it again at the next decoding step,
    a collective per step, which ranks whose completions stop at different steps would issue different numbers
    of. The rollout then makes no collective at all."""
    model = run.accelerator.unwrap_model(run.policy)
    if not (run.zero3 and run.args.ds3_gather_for_generation):
        yield model, run.zero3  # a sharded model needs every rank in each forward
        return
    import deepspeed

    offload = run.policy.optimizer.parameter_offload  # ZeRO-3's manager of the policy's sharded weights
    start_of_forward = offload.module._forward_pre_hooks[offload.fwd_pre_hook.id]
    with deepspeed.zero.GatheredParameters(list(run.policy.parameters())):
        # every hook off, the start-of-forward one too: before the first training step it checks with the other
        # ranks at each forward
        for hook in offload.forward_hooks + offload.backward_hooks + [offload.fwd_pre_hook]:
            hook.remove()
        offload.forward_hooks, offload.backward_hooks = [], []
        try:
            yield model, False
        finally:  # the hooks back, in their order, before the weights are sharded again
            offload.fwd_pre_hook = offload.module.register_forward_pre_hook(start_of_forward, prepend=True)
            offload._register_deepspeed_module(offload.module)


@contextlib.contextmanager
def reference_model(run):
    """The frozen reference: its own model, or with LoRA the policy itself with its adapters switched off."""
    if run.ref_policy is not None:
        yield run.ref_policy
        return
    policy = run.accelerator.unwrap_model(run.policy)
    with policy.disable_adapter():
        yield policy


def optimizer_step(run):
    """At the last micro-batch of a mini-batch (outside DeepSpeed, which steps inside backward): clip the gradient
    norm, step unless it is non-finite, zero the gradients. Returns 1 for a skipped step, else 0."""
    accelerator = run.accelerator
    if not accelerator.sync_gradients or run.deepspeed:
        return 0
    max_norm = run.args.max_grad_norm or math.inf  # 0: no clipping, but the norm is still checked
    grad_norm = accelerator.clip_grad_norm_(run.policy.parameters(), max_norm)
    finite = math.isfinite(grad_norm)  # one host sync per optimizer step
    if finite or accelerator.scaler is not None:
        run.optimizer.step()  # under fp16 the grad scaler itself skips a non-finite step
    run.optimizer.zero_grad()
    return int(not finite)


def rollout_sums(run, responses, response_mask, old_logprobs, sequence_kl, raw_scores, scores):
    """The rollout's sums for the metrics (this rank's; update_metrics adds them up over every rank)."""
    args = run.args
    grouped = raw_scores.view(args.rloo_k, -1)  # (k, B)
    return {
        "kl": sequence_kl.sum(),
        "neglogp": (-old_logprobs[response_mask]).sum(),
        "scores": raw_scores.sum(),
        "rlhf": (scores - args.kl_coef * sequence_kl).sum(),
        "generated": response_mask.sum(),
        "eos": ((responses == run.tokenizer.eos_token_id) & response_mask).sum(),
        "zero_std": (grouped == grouped[0]).all(0).sum(),  # prompts whose k scores are all equal
    }


@torch.no_grad()
def add_stats(stats, loss, clipfrac, new_logprobs, old_logprobs, entropy, mask, token_level):
    """Add one micro-batch to the metric sums; a "term" is a sequence, or a real token in token mode."""
    ratio_log = log_ratio(new_logprobs, old_logprobs, mask, not token_level)
    term_mask = mask if token_level else torch.ones_like(ratio_log, dtype=torch.bool)
    ratio, terms = ratio_log.exp()[term_mask], term_mask.sum()
    for name, value in [
        ("loss", loss * terms),
        ("clipfrac", clipfrac * terms),
        ("approxkl", 0.5 * (ratio_log[term_mask] ** 2).sum()),
        ("ratio", ratio.sum()),
        ("ratio_sq", (ratio**2).sum()),
        ("entropy", entropy[mask].sum()),
        ("terms", terms),
        ("tokens", mask.sum()),
    ]:
        stats[name] = stats[name] + value


def update_metrics(run, update, stats, lr, times):
    """The update's metrics from its sums, reduced over every rank in one all-reduce, which also tells every rank
    whether any of them got a stop signal. Returns (metrics, stopping)."""
    args, device = run.args, run.accelerator.device
    stats["stop_signals"] = len(run.stop_signals)
    values = torch.stack([torch.as_tensor(v, dtype=torch.float, device=device) for v in stats.values()])
    totals = dict(zip(stats, all_reduce_sum(values).tolist()))
    n, terms, tokens = args.batch_size, max(totals["terms"], 1.0), max(totals["tokens"], 1.0)
    t0, t1, t2, t3 = times
    episode = (update + 1) * args.batch_size
    mean_ratio = totals["ratio"] / terms
    metrics = {
        "update": update + 1,
        "episode": episode,
        "eps": (episode - run.start_update * args.batch_size) / max(time.perf_counter() - run.start_time, 1e-9),
        "lr": lr,
        "objective/kl": totals["kl"] / n,
        "objective/entropy": totals["neglogp"] / n,  # of the sampled tokens, summed over each completion
        "objective/non_score_reward": -args.kl_coef * totals["kl"] / n,
        "objective/rlhf_reward": totals["rlhf"] / n,
        "objective/scores": totals["scores"] / n,
        "objective/scores_clipped_frac": totals["clipped"] / n,
        "policy/approxkl_avg": totals["approxkl"] / terms,
        "policy/clipfrac_avg": totals["clipfrac"] / terms,
        "loss/policy_avg": totals["loss"] / terms,
        "policy/entropy_avg": totals["entropy"] / tokens,  # of the full distribution, per real token
        "val/ratio": mean_ratio,
        "val/ratio_var": max(totals["ratio_sq"] / terms - mean_ratio**2, 0.0),
        "val/num_eos_tokens": totals["eos"],
        "frac_reward_zero_std": totals["zero_std"] * args.rloo_k / n,  # of the prompts (n / k of them)
        **{key: total / n for key, total in totals.items() if key.startswith("rewards/")},  # before weighting
        "train/skipped_steps": run.skipped_steps,
        # where this update's time went; "other" is everything since the previous update's training ended
        # (its metrics, logging and checkpoint, then this update's data)
        "time/generation": t1 - t0,
        "time/scoring": t2 - t1,
        "time/training": t3 - t2,
        "time/other": t0 - run.previous_end,
        "time/tokens_per_second": totals["generated"] / max(t1 - t0, 1e-9),  # generated, over every rank
        "time/peak_memory_mib": peak_memory_mib(),  # this rank's
    }
    for phase in PHASES:
        run.phase_totals[phase] += metrics[f"time/{phase}"]
    run.phase_totals["tokens"] += totals["generated"]
    run.history.append(metrics["objective/scores"])
    return metrics, totals["stop_signals"] > 0


def log_update(run, update, metrics, queries, responses, scores):
    """metrics.jsonl, a progress line every twentieth of the run, sample tables, the tracker."""
    from tqdm.auto import tqdm

    args, accelerator = run.args, run.accelerator
    if accelerator.is_main_process:
        append_lines(run, "metrics.jsonl", [metrics])
        if metrics["objective/scores_clipped_frac"] > 0.1 and not run.warned_clipping:
            run.warned_clipping = True
            tqdm.write(
                f"rloo.py: warning: update {update + 1} clipped {metrics['objective/scores_clipped_frac']:.0%} of "
                f"its scores to --reward-clip-range {args.reward_clip_range}; raise it, or rescale the reward "
                "(--normalize-reward)"
            )
        if (update + 1) % max(1, args.num_total_batches // 20) == 0 or update == run.start_update:
            tqdm.write(
                f"update {update + 1}/{args.num_total_batches}  score {metrics['objective/scores']:.3f}  "
                f"kl {metrics['objective/kl']:.2f}  loss {metrics['loss/policy_avg']:.4f}  "
                f"clipfrac {metrics['policy/clipfrac_avg']:.2f}  eps {metrics['eps']:.1f}"
            )
        sample_every = max(1, args.num_total_batches // max(args.num_sample_generations, 1))
        if args.num_sample_generations > 0 and (update + 1) % sample_every == 0:
            prompts = run.tokenizer.batch_decode(queries, skip_special_tokens=True)
            completions = run.tokenizer.batch_decode(responses, skip_special_tokens=True)
            tqdm.write(f"{'prompt':<32} | {'completion':<60} | score")
            for p, c, s in zip(prompts, completions, scores.tolist()):
                tqdm.write(f"{printable(p, 32):<32} | {printable(c):<60} | {s:.3f}")
    if args.report_to != "none":
        accelerator.log(metrics, step=metrics["episode"])


def agree(flag, device):
    """True on every rank if `flag` is true on any: one all-reduce, so that every rank takes the same branch."""
    return bool(all_reduce_sum(torch.tensor([float(flag)], device=device)).item() > 0)


def rollout_is_finite(run, update, scores, advantages, logprobs):
    """The non-finite guard's verdict, the same on every rank (False: skip the update). The scores are checked
    before clipping, which would turn an inf into a finite number. A reward function that failed on any rank ends
    the run here, with a checkpoint of the last completed update."""
    bad = [~torch.isfinite(scores).all() | ~torch.isfinite(advantages).all(), ~torch.isfinite(logprobs).all()]
    failed = torch.tensor(run.reward_error is not None, device=scores.device)
    bad_scores, bad_logprobs, failed = (all_reduce_sum(torch.stack([*bad, failed]).float()) > 0).tolist()
    if failed:
        set_rng_states(run.rng_at_update_start)  # so that a resume samples this update again, the same way
        if 0 < update != run.last_saved:
            save_checkpoint(run, update)
        kept = f"checkpoint-{update} holds the last completed update" if update else "no update had completed"
        raise SystemExit(
            f"rloo.py: error: {run.reward_error or 'a reward function failed on another process'}; "
            f"stopped in update {update + 1} ({kept}); fix it and resume with --resume-from-checkpoint latest"
        )
    run.problem = "log-probs" if bad_logprobs else "scores" if bad_scores else None
    return run.problem is None


def load_eval_prompts(args, tokenizer):
    """The held-out prompts: the first num_eval_prompts of --eval-dataset-name (or --dataset-name) split
    --eval-split."""
    path = args.eval_dataset_name or args.dataset_name
    flag = "--eval-dataset-name" if args.eval_dataset_name else "--dataset-name (for evaluation, --eval-split)"
    prompts, rows, _ = load_prompts(args, tokenizer, path, args.eval_split, flag)
    if not args.eval_dataset_name and (path is None or path.endswith(".jsonl")) and main_rank():
        print(
            f"rloo.py: warning: evaluating on the training prompts ({path or 'the toy task'} has no other split); "
            "give --eval-dataset-name for held-out prompts",
            file=sys.stderr,
        )
    return prompts[: args.num_eval_prompts], rows[: args.num_eval_prompts]


@torch.no_grad()
def evaluate(run, update):
    """Held-out evaluation after `update`: one completion per prompt (greedy, or sampled at eval_temperature from a
    stream of its own), scored by the reward sources as in training (with the missing-EOS penalty). The prompts are
    shared out among the ranks, padded to equal counts so that ZeRO-3's sharded forwards stay in step; no optimizer
    step, and every random generator is left as it was, so the training run does not change."""
    args, accelerator, tokenizer = run.args, run.accelerator, run.tokenizer
    device, pad_token_id, rank = accelerator.device, tokenizer.pad_token_id, accelerator.process_index
    per_rank = math.ceil(len(run.eval_prompts) / args.world_size)
    mine = list(range(rank * per_rank, min((rank + 1) * per_rank, len(run.eval_prompts))))
    indices = (mine + [0] * per_rank)[:per_rank]  # padded with prompt 0, whose results are left out
    training_rng = rng_states()
    set_rng_states((rank_seed(args.seed, rank) + update) % 2**32)
    run.policy.eval()
    queries, query_mask = (t.to(device) for t in pad_batch([run.eval_prompts[i] for i in indices], pad_token_id))
    with generation_context(run) as (model, synced):
        responses = rollout(model, queries, query_mask, args, args.eval_temperature, pad_token_id, synced)
    responses, response_mask = truncate_response(responses, args.stop_token_id, pad_token_id)
    rows = [run.eval_rows[i] for i in indices]
    query_responses = torch.cat([queries, responses], 1)
    attention_mask = torch.cat([query_mask, response_mask.long()], 1)
    scores, rewards = score_completions(run, rows, query_responses, attention_mask, queries.shape[1], response_mask)
    if args.missing_eos_penalty is not None:
        missing_stop = ~has_stop_token(responses, response_mask, args.stop_token_id)
        scores = scores - args.missing_eos_penalty * missing_stop.float()
    set_rng_states(training_rng)
    real = torch.arange(per_rank, device=device) < len(mine)  # (per_rank,) not padding
    sums = {
        "eval/scores": scores,
        "eval/completion_length": response_mask.sum(1).float(),
        "eval/num_eos_tokens": ((responses == tokenizer.eos_token_id) & response_mask).sum(1).float(),
        **{f"eval/rewards/{name}": values for name, values in rewards.items()},
    }
    sums["failed"] = torch.full_like(scores, float(run.reward_error is not None))  # a reward function failed
    totals = dict(zip(sums, all_reduce_sum(torch.stack([torch.where(real, v, 0.0).sum() for v in sums.values()]))))
    if totals.pop("failed") > 0:  # every rank stops after the update, in end_of_update
        run.reward_error = run.reward_error or "a reward function failed on another process (in the evaluation)"
        return
    metrics = {"update": update} | {key: total.item() / len(run.eval_prompts) for key, total in totals.items()}
    metrics["eval/num_eos_tokens"] *= len(run.eval_prompts)  # a count over the evaluation, like val/num_eos_tokens
    completions = tokenizer.batch_decode(responses, skip_special_tokens=True)
    records = [
        {"update": update, "prompt": row[args.dataset_text_field], "completion": text, "score": score}
        for row, text, score in zip(rows, completions, scores.tolist())
    ][: len(mine)]
    if args.world_size > 1:
        from accelerate.utils import gather_object

        records = gather_object(records)
    if accelerator.is_main_process:
        append_lines(run, "metrics.jsonl", [metrics])
        append_lines(run, "eval_completions.jsonl", records)
    if args.report_to != "none":
        accelerator.log(metrics, step=update * args.batch_size)


def eval_due(args, done):
    """Whether the evaluation schedule holds an evaluation after `done` updates: every eval_steps, and the last."""
    return bool(args.eval_steps) and done > 0 and (done % args.eval_steps == 0 or done == args.num_total_batches)


def end_of_update(run, update, stopping):
    """After the update's metrics: the evaluation (not when stopping: a preempted run has little time), then
    checkpoints every save_steps updates, at the end, on preemption, and when the run must stop."""
    args, done, device = run.args, update + 1, run.accelerator.device
    if eval_due(args, done) and not stopping:  # when stopping, the resume evaluates first (see start_lineage)
        evaluate(run, done)
    if run.consecutive_skips >= 3 and run.problem == "log-probs":  # no checkpoint: the weights themselves may be NaN
        raise SystemExit(
            f"rloo.py: stopped at update {done}: the policy's log-probs were not finite in 3 updates in a "
            f"row: its weights diverged, or --temperature {args.temperature} is too small; lower "
            f"--learning-rate (now {args.learning_rate}) or raise --temperature, and resume from an "
            "earlier checkpoint"
        )
    failed_write = agree(run.write_error is not None, device)  # the main process alone appends to the files
    failed = run.consecutive_skips >= 3 or run.reward_error is not None or failed_write
    if done % args.save_steps == 0 or done == args.num_total_batches or stopping or failed:
        save_checkpoint(run, done)
    if failed:
        why = (
            "non-finite scores (NaN or inf) in 3 updates in a row; check the reward function or model"
            if run.consecutive_skips >= 3
            else run.reward_error or run.write_error or "a write failed on rank 0"
        )
        raise SystemExit(f"rloo.py: error: stopped after update {done}: {why} (checkpoint-{done} holds the run so far)")
    if stopping:
        number = run.stop_signals[0] if run.stop_signals else signal.SIGTERM  # another rank's signal: stop alike
        if run.accelerator.is_main_process:
            print(
                f"rloo.py: stopped by {signal.Signals(number).name} after update {done}; checkpoint written. Resume "
                f"with: --output-dir {args.output_dir} --resume-from-checkpoint latest",
                file=sys.stderr,
            )
        sys.exit(128 + number)  # 130 for SIGINT, 143 for SIGTERM


def append_lines(run, name, records):
    """Append JSON lines to a file of the output directory (main process); a failure (a full disk) is kept for
    end_of_update, which stops every rank together."""
    try:
        with open(os.path.join(run.args.output_dir, name), "a") as f:
            f.writelines(json.dumps(record) + "\n" for record in records)
    except OSError as error:
        run.write_error = f"cannot append to {name}: {error.strerror} ({free_space(run.args.output_dir)})"


def save_checkpoint(run, update):
    """Weights, optimizer, RNG of every rank (accelerate's save_state), plus the counters and the size of every
    file, into checkpoint-<update>.tmp, renamed into place once complete: a crash or a full disk mid-save leaves
    the previous checkpoint intact. Every rank learns of a failure on any rank, and all stop with one line."""
    accelerator, args = run.accelerator, run.args
    final = os.path.join(args.output_dir, f"checkpoint-{update}")
    tmp, failure = final + ".tmp", None
    if accelerator.is_main_process and os.path.exists(tmp):
        shutil.rmtree(tmp)
    accelerator.wait_for_everyone()
    try:
        accelerator.save_state(tmp)
    except Exception as error:  # safetensors and torch.save report a full disk in their own words
        failure = error
    if not agree(failure is not None, accelerator.device) and accelerator.is_main_process:  # every rank's files
        files = {
            os.path.relpath(os.path.join(d, f), tmp): os.path.getsize(os.path.join(d, f))
            for d, _, names in os.walk(tmp)
            for f in names
        }
        state = {
            "update": update,
            "world_size": args.world_size,
            "args": asdict(args),
            "score_history": run.history,
            "elapsed": run.elapsed_before + time.perf_counter() - run.start_time,
            "files": files,
            "skipped_steps": run.skipped_steps,
            "consecutive_skips": run.consecutive_skips,
        }
        try:
            with open(os.path.join(tmp, "trainer_state.json"), "w") as f:
                json.dump(state, f)
            if os.path.exists(final):
                shutil.rmtree(final)
            os.replace(tmp, final)
        except OSError as error:
            failure = error
    if agree(failure is not None, accelerator.device):
        shutil.rmtree(tmp, ignore_errors=True)
        raise SystemExit(
            f"rloo.py: error: cannot write {tmp}: {first_line(failure or 'on another process')} "
            f"({free_space(args.output_dir)}); free space, then resume from the last checkpoint"
        )
    run.last_saved = update
    if accelerator.is_main_process and args.save_total_limit:
        for old in checkpoint_dirs(args.output_dir)[: -args.save_total_limit]:
            shutil.rmtree(old)
    accelerator.wait_for_everyone()


def free_space(path):
    free = shutil.disk_usage(path).free
    return "no space left on that device" if free < 2**20 else f"{free / 2**20:.0f} MiB free on that device"


def save_final_model(run):
    """The final policy as a normal save_pretrained directory, loadable on one device (with LoRA: the adapter, as
    a peft directory, and with --merge-adapter the merged model in output_dir/merged); then the speed report."""
    accelerator, args = run.accelerator, run.args
    state_dict = accelerator.get_state_dict(run.policy)  # under ZeRO-3, gathers the full weights from every rank
    if accelerator.is_main_process:
        unwrapped = accelerator.unwrap_model(run.policy)
        unwrapped.save_pretrained(args.output_dir, state_dict=state_dict, safe_serialization=True)
        run.tokenizer.save_pretrained(args.output_dir)
        if args.merge_adapter:  # the adapter on a fresh float32 copy of the base, merged: works whatever the sharding
            from peft import PeftModel

            merged = PeftModel.from_pretrained(load_policy(args, run.tokenizer), args.output_dir).merge_and_unload()
            merged.save_pretrained(os.path.join(args.output_dir, "merged"))
            run.tokenizer.save_pretrained(os.path.join(args.output_dir, "merged"))
        if args.push_to_hub:
            unwrapped.push_to_hub(args.hub_model_id or args.run_name)
            run.tokenizer.push_to_hub(args.hub_model_id or args.run_name)
    accelerator.wait_for_everyone()
    accelerator.end_training()
    if accelerator.is_main_process and run.history:
        print_speed_report(run)


def print_speed_report(run):
    """The run's own speed report: throughput, where an update's time went, peak memory; then the score's rise."""
    args, totals = run.args, run.phase_totals
    session = max(now() - run.start_time, 1e-9)
    updates_run = args.num_total_batches - run.start_update
    phases = sum(totals[p] for p in PHASES)
    shares = ", ".join(f"{p} {100 * totals[p] / max(phases, 1e-9):.0f}%" for p in PHASES)
    memory = "peak GPU memory" if torch.cuda.is_available() else "peak RSS"
    print(
        f"speed: {updates_run * args.batch_size / session:.1f} episodes/s, "
        f"{totals['tokens'] / max(totals['generation'], 1e-9):.0f} generated tokens/s while generating, "
        f"{phases / max(updates_run, 1):.3f} s/update ({shares}); {memory} {peak_memory_mib():.0f} MiB (rank 0)"
    )
    tenth = max(1, len(run.history) // 10)
    print(
        f"done in {run.elapsed_before + session:.0f}s: {args.num_total_batches} updates, "
        f"{args.num_total_batches * args.batch_size} episodes; mean score {np.mean(run.history[:tenth]):.3f} "
        f"(first tenth) -> {np.mean(run.history[-tenth:]):.3f} (last tenth); model saved to {args.output_dir}"
    )


def progress(run):
    """The updates still to run, with a progress bar on the main process; prints the run's header and starts
    its clocks."""
    from tqdm.auto import tqdm

    args, is_main = run.args, run.accelerator.is_main_process
    threads = "" if torch.cuda.is_available() else f", {torch.get_num_threads()} CPU threads each"
    sizes = [(getattr(p, "ds_numel", p.numel()), p.requires_grad) for p in run.policy.parameters()]  # ZeRO-3: whole
    trainable = f"{sum(n for n, grad in sizes if grad):,} of {sum(n for n, _ in sizes):,} parameters trained"
    if is_main:
        print(
            f"{args.run_name}: {args.num_total_batches} updates of {args.batch_size} completions "
            f"({args.local_dataloader_batch_size} prompts x k={args.rloo_k} per process, {args.world_size} "
            f"processes{threads}; {trainable}) -> {args.output_dir}"
        )
    run.start_time = run.previous_end = now()
    updates = range(run.start_update, args.num_total_batches)
    for update in tqdm(updates, disable=not is_main, initial=run.start_update, total=args.num_total_batches):
        run.rng_at_update_start, run.reward_error = rng_states(), None
        yield update


def now():
    if torch.cuda.is_available():
        torch.cuda.synchronize()  # time what the GPU did, not what was queued
    return time.perf_counter()


def peak_memory_mib():
    """Peak memory so far: allocated GPU memory on a GPU, the process's resident set size (RSS) on the CPU."""
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def printable(text, width=60):
    """Control characters and invalid bytes from a random policy, escaped for a terminal."""
    text = repr(text)[1:-1]
    return text if len(text) <= width else text[: width - 3] + "..."


if __name__ == "__main__":
    main(tyro.cli(Args))
