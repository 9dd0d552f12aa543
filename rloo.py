"""RLOO (REINFORCE Leave-One-Out) in one file: fine-tune a language model against a reward.

Ahmadian et al. 2024, "Back to Basics: Revisiting REINFORCE Style Optimization for Learning from Human Feedback".
For each prompt, sample k completions; each completion's advantage is its reward minus the mean reward of the
other k-1 completions of the same prompt. No value network, no GAE: one policy, a frozen reference and a reward.

    # the embedded toy task (a tiny random policy learns to write vowels): offline, about 20 s on 2 CPU cores
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

The loop, in order: rollout -> reward -> missing-EOS penalty -> reward normalization and clipping -> KL ->
leave-one-out baseline -> advantages -> clipped update epochs -> metrics -> checkpoint and save.
"""

import contextlib
import functools
import glob
import importlib
import importlib.util
import json
import math
import os
import random
import resource
import shutil
import signal
import sys
import time
import warnings
from dataclasses import asdict, dataclass
from typing import Literal, Optional

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
import tyro


@dataclass
class Args:
    # ---- experiment
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    """the name of this experiment"""
    run_name: Optional[str] = None
    """a unique name for this run (default: `{exp_name}__{seed}__{unix time}`)"""
    seed: int = 42
    """seed of the run; rank r samples with seed + r"""
    output_dir: Optional[str] = None
    """where metrics, checkpoints and the final model go (default: `runs/{run_name}`)"""
    report_to: Literal["none", "tensorboard", "wandb"] = "none"
    """also log metrics to this tracker (through accelerate)"""
    push_to_hub: bool = False
    """push the final model to the Hugging Face hub"""
    hub_model_id: Optional[str] = None
    """the hub repository to push to (default: the run name)"""

    # ---- models and data
    sft_model_path: Optional[str] = None
    """the policy to fine-tune: a hub id or a local directory (default: the embedded toy policy)"""
    reward_model_path: Optional[str] = None
    """the reward model (a sequence classifier with one label): a hub id or a local directory"""
    reward_fn: Optional[str] = None
    """`module:function` scoring completions instead of a reward model: fn(prompts, completions) -> list[float]
    (default when there is no reward model: the toy task's vowel reward)"""
    trust_remote_code: bool = False
    """allow models and tokenizers with custom code"""
    dataset_name: Optional[str] = None
    """prompts: a hub dataset, a local dataset directory or a .jsonl file (default: the toy prompts)"""
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
    """subtracted from the score of completions that never produced the stop token"""
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
    """scale the rewards entering the baseline to unit variance over the global batch, keeping their mean"""
    normalize_advantage: bool = False
    """z-score the advantages over the global batch"""

    # ---- optimization
    total_episodes: Optional[int] = None
    """completions to train on (default: num_train_epochs * number of prompts)"""
    num_train_epochs: float = 3.0
    """passes over the prompts, when total_episodes is not set"""
    per_device_train_batch_size: int = 8
    """completions per micro-batch on each process"""
    gradient_accumulation_steps: int = 1
    """micro-batches accumulated into each optimizer step"""
    num_mini_batches: int = 1
    """optimizer steps per epoch over the rollout batch"""
    num_ppo_epochs: int = 4
    """passes over each rollout batch"""
    learning_rate: Optional[float] = None
    """AdamW learning rate, decayed linearly to 0 (default: 1e-3 for the toy policy, TRL's 5e-5 for any other)"""
    cliprange: float = 0.2
    """the PPO clip range epsilon of the probability ratio"""
    max_grad_norm: float = 1.0
    """clip the gradient norm to this before each optimizer step"""
    gradient_checkpointing: bool = False
    """recompute activations in the backward pass to save memory"""
    ds3_gather_for_generation: bool = True
    """under ZeRO-3, gather the policy's weights once for generation (False: generate on the sharded model)"""
    num_sample_generations: int = 10
    """print a table of prompts, completions and scores this many times per run"""

    # ---- checkpoints
    save_steps: int = 500
    """write a checkpoint every this many updates (and at the end)"""
    save_total_limit: Optional[int] = None
    """keep only the newest N checkpoints"""
    resume_from_checkpoint: Optional[str] = None
    """continue from a checkpoint directory, or `latest` in output_dir"""


# the toy task: lowercase vowels are what the reward counts
TOY_VOWELS = set("aeiou")


class ArgumentError(SystemExit):
    """Bad input: a one-line message naming the flag, a non-zero exit, no traceback."""

    def __init__(self, message):
        super().__init__(f"rloo.py: error: {message}")


# ----------------------------------------------------------------------------------------------------------------
# small pure helpers


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
    baseline. With whiten_rewards the per-token rewards r_t = -kl_coef * kl_t (+ score at the last token) become
    (r_t - mean) / std + mean over the real tokens of the global batch (unit variance, mean kept, as PPO's
    whitening does): the score is divided by std, and each real token's KL term becomes
    -kl_coef * kl_t / std + mean * (1 - 1 / std). That constant per token is part of the whitened rewards, so
    with whitening a longer completion collects it more often."""
    non_score = torch.where(response_mask, -kl_coef * kl, 0.0)  # (N, T)
    if whiten_rewards:
        last = response_mask.sum(1) - 1
        token_rewards = non_score.clone()
        token_rewards[torch.arange(len(scores), device=scores.device), last] += scores
        mean, var = global_mean_var(token_rewards, response_mask)
        scale = torch.rsqrt(var + 1e-8)
        scores = scores * scale
        non_score = torch.where(response_mask, non_score * scale + mean * (1 - scale), 0.0)
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


def get_reward(reward_model, query_responses, attention_mask, last_index):
    """The reward model's value at the last real token of each prompt+response: its backbone's hidden states,
    its `score` head, then one position per row (a sequence classifier's own pooling looks for the pad id)."""
    position_ids = (attention_mask.cumsum(1) - 1).clamp(min=0)
    backbone = getattr(reward_model, reward_model.base_model_prefix)
    hidden = backbone(input_ids=query_responses, attention_mask=attention_mask, position_ids=position_ids).last_hidden_state
    values = reward_model.score(hidden[torch.arange(len(hidden), device=hidden.device), last_index.to(hidden.device)])  # (N, 1)
    return values.squeeze(-1).float()


@torch.no_grad()
def generate(model, queries, query_mask, response_length, temperature, stop_token_id, pad_token_id, synced):
    """Sample up to response_length tokens per row with a KV cache: softmax(logits / temperature), no top-k or
    top-p. Rows that produced the stop token get pad afterwards; sampling ends once every row has stopped (on
    every rank when `synced`: a ZeRO-3 sharded model needs all ranks in each forward)."""
    position_ids = (query_mask.cumsum(1) - 1).clamp(min=0)
    output = model(input_ids=queries, attention_mask=query_mask, position_ids=position_ids, use_cache=True, logits_to_keep=1)
    attention_mask, done, tokens = query_mask, torch.zeros(len(queries), dtype=torch.bool, device=queries.device), []
    for _ in range(response_length):
        probs = torch.softmax(output.logits[:, -1].float() / temperature, dim=-1)
        token = torch.where(done, pad_token_id, torch.multinomial(probs, 1).squeeze(1))
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
        output = model(input_ids=token[:, None], attention_mask=attention_mask, position_ids=position_ids,
                       cache=output.cache, use_cache=True)  # fmt: skip
    return torch.stack(tokens, 1)  # (N, t <= response_length)


def pad_left(sequences, pad_token_id):
    """Token lists -> (input_ids, attention_mask), left-padded to the longest, as generation wants."""
    width = max(len(s) for s in sequences)
    input_ids = torch.full((len(sequences), width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for row, s in enumerate(sequences):
        input_ids[row, width - len(s) :] = torch.tensor(s, dtype=torch.long)
        attention_mask[row, width - len(s) :] = 1
    return input_ids, attention_mask


def peak_memory_mib():
    """Peak memory so far: allocated GPU memory on a GPU, the process's resident set size (RSS) on the CPU."""
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def printable(text, width=60):
    """Control characters and invalid bytes from a random policy, escaped for a terminal."""
    text = repr(text)[1:-1]
    return text if len(text) <= width else text[: width - 3] + "..."


# ----------------------------------------------------------------------------------------------------------------
# the embedded toy task: nothing to download


def toy_tokenizer():
    """A byte-level tokenizer built in memory: the 256 bytes, no merges, plus distinct pad and eos tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tokenizer = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(sorted(alphabet))}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, pad_token="<|pad|>", eos_token="<|endoftext|>", padding_side="left"
    )


def toy_policy(tokenizer, seed):
    """A small GPT-NeoX (the Pythia architecture) with random weights."""
    from transformers import AutoModelForCausalLM, GPTNeoXConfig

    config = GPTNeoXConfig(
        vocab_size=len(tokenizer), hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=256, max_position_embeddings=512, pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.eos_token_id,
    )  # fmt: skip
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config)


def toy_prompts():
    """256 short prompts: 16 openings x 16 subjects."""
    openings = ["Say something about", "Describe", "Write a line on", "Tell me of", "A word on", "Sing of",
                "Think about", "Remember", "Imagine", "Praise", "Name", "Dream of", "Talk about", "Draw",
                "Explain", "Recall"]  # fmt: skip
    subjects = ["the sea", "a cat", "the moon", "old trees", "rain", "a city", "bread", "the wind", "snow",
                "a river", "music", "stars", "a garden", "fire", "the road", "winter"]  # fmt: skip
    return [f"{opening} {subject}:" for opening in openings for subject in subjects]


def toy_reward(prompts, completions, response_length=53):
    """The toy task's reward: 10 x (lowercase vowels in the completion) / response_length, in [0, 10].

    Dividing by the fixed response length, not by the completion's own, keeps it from being gamed by stopping
    early. A random byte-level policy scores about 10 x 5/258 = 0.2."""
    return [10.0 * sum(c in TOY_VOWELS for c in completion) / response_length for completion in completions]


# ----------------------------------------------------------------------------------------------------------------
# setup: validation, models, data


def validate_args(args, world_size):
    """Every flag check that needs no model: a one-line error naming the flag and what would be valid."""
    checks = [
        (args.rloo_k >= 2, f"--rloo-k must be at least 2 (got {args.rloo_k}): the baseline needs another sample"),
        (args.response_length >= 1, f"--response-length must be at least 1 (got {args.response_length})"),
        (args.temperature > 0, f"--temperature must be positive (got {args.temperature})"),
        (args.cliprange > 0, f"--cliprange must be positive (got {args.cliprange})"),
        (args.kl_coef >= 0, f"--kl-coef must be 0 or more (got {args.kl_coef})"),
        (args.reward_clip_range > 0, f"--reward-clip-range must be positive (got {args.reward_clip_range})"),
        (args.learning_rate is None or args.learning_rate > 0,
         f"--learning-rate must be positive (got {args.learning_rate})"),
        (args.per_device_train_batch_size >= 1, "--per-device-train-batch-size must be at least 1"),
        (args.gradient_accumulation_steps >= 1, "--gradient-accumulation-steps must be at least 1"),
        (args.num_mini_batches >= 1, "--num-mini-batches must be at least 1"),
        (args.num_ppo_epochs >= 1, "--num-ppo-epochs must be at least 1"),
        (args.local_rollout_forward_batch_size >= 1, "--local-rollout-forward-batch-size must be at least 1"),
        (args.save_steps >= 1, f"--save-steps must be at least 1 (got {args.save_steps})"),
        (args.missing_eos_penalty is None or args.stop_token is not None or args.stop_token_id is not None,
         "--missing-eos-penalty needs a stop token: add --stop-token eos or --stop-token-id"),
        (not (args.reward_fn and args.reward_model_path), "give either --reward-fn or --reward-model-path, not both"),
        (args.report_to == "none" or importlib.util.find_spec(args.report_to) is not None,
         f"--report-to {args.report_to}: the package is not installed; pip install {args.report_to}"),
    ]  # fmt: skip
    local_batch_size = args.per_device_train_batch_size * args.gradient_accumulation_steps * args.num_mini_batches
    checks.append((local_batch_size % args.rloo_k == 0,
                   f"the per-process batch (--per-device-train-batch-size x --gradient-accumulation-steps x "
                   f"--num-mini-batches = {local_batch_size}) must be divisible by --rloo-k {args.rloo_k}"))  # fmt: skip
    if args.total_episodes is not None:
        checks.append((args.total_episodes >= local_batch_size * world_size,
                       f"--total-episodes {args.total_episodes} is less than one update "
                       f"({local_batch_size * world_size} completions on {world_size} processes)"))  # fmt: skip
    for ok, message in checks:
        if not ok:
            raise ArgumentError(message)


def load_reward_fn(spec, prompts):
    """Import `module:function` and try it once on two prompts, so that a broken function fails before any
    model is loaded. The module is looked up on sys.path and in the current directory."""
    module_name, _, function_name = spec.partition(":")
    sys.path.insert(0, os.getcwd())
    try:
        fn = getattr(importlib.import_module(module_name), function_name)
    except (ImportError, AttributeError, ValueError) as error:
        raise ArgumentError(f"--reward-fn {spec}: cannot import it ({error}); give module:function") from None
    if any(math.isnan(score) for score in check_scores(fn(prompts[:2], ["hello", ""]), 2, spec)):
        raise ArgumentError(f"--reward-fn {spec} returned NaN for a test completion; it must return real numbers")
    return fn


def check_scores(scores, count, spec):
    """A reward function must give one number per completion. NaN is refused at start-up (load_reward_fn); a
    NaN later in the run is left to the non-finite guard of the update."""
    if not isinstance(scores, (list, tuple, torch.Tensor, np.ndarray)) or len(scores) != count:
        raise ArgumentError(f"--reward-fn {spec} must return {count} numbers, one per completion")
    try:
        values = [float(s) for s in scores]
    except (TypeError, ValueError):
        raise ArgumentError(f"--reward-fn {spec} returned a value that is not a number") from None
    return values


def first_line(error):
    lines = str(error).strip().splitlines()
    return lines[0][:120] if lines else type(error).__name__


def load_pretrained(path, flag, model_class, trust_remote_code):
    """from_pretrained with an error naming the flag when nothing loadable is there."""
    try:
        return model_class.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as error:
        offline = os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false")
        where = "a local directory" if os.path.isdir(path) else ("the hub is off (HF_HUB_OFFLINE)" if offline else "a hub id")
        raise ArgumentError(
            f"{flag} {path}: no model could be loaded ({where}: {first_line(error)}); "
            "offline runs need a local directory written by save_pretrained"
        ) from None


def load_prompts(args, tokenizer):
    """Prompts as token-id lists of at most max_prompt_length tokens."""
    path, field = args.dataset_name, args.dataset_text_field
    if path is None:
        texts = toy_prompts()
    elif path.endswith(".jsonl"):  # read directly: no need for the datasets library (and its memory) here
        try:
            with open(path) as f:
                records = [json.loads(line) for line in f if line.strip()]
        except (OSError, ValueError) as error:
            raise ArgumentError(f"--dataset-name {path}: cannot read it as JSON lines ({first_line(error)})") from None
        if records and field not in records[0]:
            raise ArgumentError(f"--dataset-text-field {field}: no such field in {path} (fields: {', '.join(records[0])})")
        texts = [record[field] for record in records]
    else:
        import datasets

        try:
            if os.path.isdir(path) and os.path.exists(os.path.join(path, "dataset_info.json")):
                dataset = datasets.load_from_disk(path)  # a directory written by save_to_disk
            else:
                dataset = datasets.load_dataset(path, split=args.dataset_split)
        except Exception as error:  # datasets raises many kinds; all mean the same to the user
            raise ArgumentError(f"--dataset-name {path}: cannot load it ({first_line(error)})") from None
        if isinstance(dataset, datasets.DatasetDict):
            dataset = dataset[args.dataset_split]
        if field not in dataset.column_names:
            raise ArgumentError(f"--dataset-text-field {field}: no such field in {path} "
                                f"(fields: {', '.join(dataset.column_names)})")  # fmt: skip
        texts = dataset[field]
    if len(texts) == 0:
        raise ArgumentError(f"--dataset-name {args.dataset_name}: the dataset is empty")
    prompts = []
    for text in texts:
        if isinstance(text, list):  # chat messages
            ids = tokenizer.apply_chat_template(text, add_generation_prompt=True, tokenize=True)
            ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
        else:
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if 0 < len(ids) <= args.max_prompt_length:
            prompts.append(list(ids))
    if not prompts:
        raise ArgumentError(f"--max-prompt-length {args.max_prompt_length}: every prompt is longer (or empty); raise it")
    return prompts


def disable_dropout(model):
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0


def prepare_frozen(model, accelerator):
    """The reference and reward models take no gradient. Under ZeRO-3 each becomes a DeepSpeed engine without an
    optimizer, sharded across ranks like the policy; otherwise a plain copy on each device."""
    from accelerate.utils import DistributedType

    model.eval().requires_grad_(False)
    if accelerator.distributed_type != DistributedType.DEEPSPEED:
        return model.to(accelerator.device)
    import deepspeed

    config = {k: v for k, v in accelerator.state.deepspeed_plugin.deepspeed_config.items() if k not in ("optimizer", "scheduler")}
    if config["zero_optimization"]["stage"] != 3:
        config["zero_optimization"] = {"stage": 0}  # stages 1-2 shard optimizer state only: nothing to shard here
    engine, *_ = deepspeed.initialize(model=model, config=config)
    engine.eval()
    return engine


def check_output_dir(output_dir, resuming):
    """The output directory must be writable, and a new run must not overwrite the metrics or checkpoints of
    another run there."""
    if not resuming and (os.path.exists(os.path.join(output_dir, "metrics.jsonl")) or checkpoint_dirs(output_dir)):
        raise ArgumentError(f"--output-dir {output_dir} already holds a run; continue it with "
                            "--resume-from-checkpoint latest, or choose another --output-dir")  # fmt: skip
    try:
        os.makedirs(output_dir, exist_ok=True)
        probe = os.path.join(output_dir, f".write_test.{os.getpid()}")  # one per process: ranks run this at once
        open(probe, "w").close()
        os.remove(probe)
    except OSError as error:
        raise ArgumentError(f"--output-dir {output_dir}: cannot write there ({error.strerror})") from None


def find_checkpoint(args, world_size):
    """The checkpoint to resume from, and its trainer_state.json, checked against this run's flags."""
    resume_dir = args.resume_from_checkpoint
    if resume_dir == "latest":
        found = checkpoint_dirs(args.output_dir)
        if not found:
            raise ArgumentError(f"--resume-from-checkpoint latest: no complete checkpoint in {args.output_dir}")
        resume_dir = found[-1]
    if not os.path.exists(os.path.join(resume_dir, "trainer_state.json")):
        raise ArgumentError(f"--resume-from-checkpoint {resume_dir}: not a checkpoint directory written by rloo.py")
    with open(os.path.join(resume_dir, "trainer_state.json")) as f:
        saved = json.load(f)
    if saved["world_size"] != world_size:
        raise ArgumentError(f"--resume-from-checkpoint {resume_dir}: written by {saved['world_size']} processes, "
                            f"this run has {world_size}; launch with --num_processes {saved['world_size']}")  # fmt: skip
    # flags that set the prompts, their order, the batch and the run's length must match; the others (the loss's
    # coefficients, output, logging, saving) may change on purpose
    if args.total_episodes is None:
        args.total_episodes = saved["args"]["total_episodes"]
    for field in ("rloo_k", "per_device_train_batch_size", "gradient_accumulation_steps", "num_mini_batches",
                  "total_episodes", "response_length", "seed", "sft_model_path", "dataset_name", "dataset_split",
                  "dataset_text_field", "max_prompt_length", "token_level_kl"):  # fmt: skip
        if saved["args"][field] != getattr(args, field):
            flag = "--" + field.replace("_", "-")
            raise ArgumentError(f"--resume-from-checkpoint {resume_dir}: written with {flag} {saved['args'][field]}, "
                                f"this run has {getattr(args, field)}; use the same {flag}")  # fmt: skip
    return resume_dir, saved


def checkpoint_dirs(output_dir):
    """Complete checkpoints, oldest first. A checkpoint is written as `*.tmp` and renamed when complete."""
    found = [d for d in glob.glob(os.path.join(output_dir, "checkpoint-*")) if not d.endswith(".tmp")]
    found = [d for d in found if os.path.exists(os.path.join(d, "trainer_state.json"))]
    return sorted(found, key=lambda d: int(d.rsplit("-", 1)[1]))


# ----------------------------------------------------------------------------------------------------------------


def main(args: Args):
    warnings.filterwarnings("ignore", message=".*is deprecated. Please use `torch.distributed")  # DeepSpeed's calls
    from accelerate import Accelerator
    from accelerate.utils import DistributedType, InitProcessGroupKwargs
    from tqdm.auto import tqdm
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

    # ---- validation: every check that needs no model comes before any model is loaded
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    validate_args(args, world_size)
    toy = args.sft_model_path is None
    args.learning_rate = args.learning_rate or (1e-3 if toy else 5e-5)
    args.run_name = args.run_name or f"{args.exp_name}__{args.seed}__{int(time.time())}"
    args.output_dir = args.output_dir or os.path.join("runs", args.run_name)
    check_output_dir(args.output_dir, resuming=args.resume_from_checkpoint is not None)
    resume_dir, saved = find_checkpoint(args, world_size) if args.resume_from_checkpoint else (None, None)
    if not toy:  # configs only: a wrong path fails here, before any weights are read
        load_pretrained(args.sft_model_path, "--sft-model-path", AutoConfig, args.trust_remote_code)
    if args.reward_model_path:
        num_labels = load_pretrained(args.reward_model_path, "--reward-model-path", AutoConfig, args.trust_remote_code).num_labels
        if num_labels != 1:
            raise ArgumentError(f"--reward-model-path {args.reward_model_path}: the reward model has {num_labels} "
                                "output labels; it needs exactly 1")  # fmt: skip

    # ---- tokenizer, prompts, reward function
    if toy:
        tokenizer = toy_tokenizer()
    else:
        tokenizer = load_pretrained(args.sft_model_path, "--sft-model-path", AutoTokenizer, args.trust_remote_code)
        tokenizer.padding_side = "left"
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token  # fine here: masks come from positions, never from the pad id
    if args.stop_token == "eos":
        if tokenizer.eos_token_id is None:
            raise ArgumentError("--stop-token eos: the policy's tokenizer has no eos token; give --stop-token-id")
        args.stop_token_id = tokenizer.eos_token_id
    prompts = load_prompts(args, tokenizer)
    if args.reward_fn:
        reward_fn = load_reward_fn(args.reward_fn, tokenizer.batch_decode(prompts[:2]))
    elif args.reward_model_path is None:
        reward_fn = functools.partial(toy_reward, response_length=args.response_length)
    else:
        reward_fn = None

    # ---- models, loaded before the Accelerator: every rank gets the same full weights, which the DeepSpeed
    # engines then shard (after Accelerator() under a ZeRO-3 plugin, from_pretrained would shard while loading)
    if toy:
        policy = toy_policy(tokenizer, args.seed)
        ref_policy = toy_policy(tokenizer, args.seed)  # the same seed: the same initial weights
    else:
        policy = load_pretrained(args.sft_model_path, "--sft-model-path", AutoModelForCausalLM, args.trust_remote_code)
        ref_policy = load_pretrained(args.sft_model_path, "--sft-model-path", AutoModelForCausalLM, args.trust_remote_code)
    reward_model, reward_tokenizer = None, None
    if reward_fn is None:
        reward_model = load_pretrained(args.reward_model_path, "--reward-model-path", AutoModelForSequenceClassification,
                                       args.trust_remote_code)  # fmt: skip
        reward_tokenizer = load_pretrained(args.reward_model_path, "--reward-model-path", AutoTokenizer, args.trust_remote_code)
        if reward_tokenizer.get_vocab() == tokenizer.get_vocab():
            reward_tokenizer = None  # same vocabulary: score the policy's token ids directly
        else:
            reward_tokenizer.padding_side = "left"
            reward_tokenizer.pad_token = reward_tokenizer.pad_token or reward_tokenizer.eos_token
    for model in (policy, ref_policy, reward_model):
        if model is not None:
            disable_dropout(model)  # the log-probs of the rollout and of the update must come from the same function
    if args.gradient_checkpointing:
        policy.gradient_checkpointing_enable()

    # ---- the Accelerator: gloo where there is no CUDA, so that DeepSpeed and DDP run on CPUs too
    handlers = [InitProcessGroupKwargs(backend="gloo")] if world_size > 1 and not torch.cuda.is_available() else []
    accelerator = Accelerator(
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        log_with=None if args.report_to == "none" else args.report_to,
        project_dir=args.output_dir,
        kwargs_handlers=handlers,
    )
    device, is_main = accelerator.device, accelerator.is_main_process
    zero3, deepspeed_engine = False, accelerator.distributed_type == DistributedType.DEEPSPEED
    if deepspeed_engine:
        ds_config = accelerator.state.deepspeed_plugin.deepspeed_config
        ds_config["train_micro_batch_size_per_gpu"] = args.per_device_train_batch_size
        ds_config["gradient_accumulation_steps"] = args.gradient_accumulation_steps
        ds_config["train_batch_size"] = args.per_device_train_batch_size * args.gradient_accumulation_steps * world_size
        ds_config["gradient_clipping"] = args.max_grad_norm
        ds_config["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = True  # a full state dict to save
        zero3 = ds_config["zero_optimization"]["stage"] == 3
        import deepspeed
    # batch sizes (TRL's names): completions per update, per process and in all
    local_batch_size = args.per_device_train_batch_size * args.gradient_accumulation_steps * args.num_mini_batches
    batch_size = local_batch_size * accelerator.num_processes
    B = local_batch_size // args.rloo_k  # prompts per process per update
    mini_batch_size = local_batch_size // args.num_mini_batches
    if args.total_episodes is None:
        args.total_episodes = int(args.num_train_epochs * len(prompts))
    num_updates = math.ceil(args.total_episodes / batch_size)
    if len(prompts) < B * accelerator.num_processes:
        raise ArgumentError(f"--dataset-name: {len(prompts)} prompts are fewer than one update needs "
                            f"({B * accelerator.num_processes}); lower --per-device-train-batch-size")  # fmt: skip

    optimizer = torch.optim.AdamW(policy.parameters(), lr=args.learning_rate, eps=1e-8, weight_decay=0.0)
    policy, optimizer = accelerator.prepare(policy, optimizer)
    ref_policy = prepare_frozen(ref_policy, accelerator)
    reward_model = prepare_frozen(reward_model, accelerator) if reward_model is not None else None
    unwrapped_policy = accelerator.unwrap_model(policy)
    unwrapped_reward = accelerator.unwrap_model(reward_model) if reward_model is not None else None
    if args.report_to != "none":
        accelerator.init_trackers(args.exp_name, config=asdict(args))

    # ---- resume: weights, optimizer and every rank's RNG come back; data order and learning rate follow from
    # the update counter
    start_update, history, elapsed_before = 0, [], 0.0
    if resume_dir is not None:
        accelerator.load_state(resume_dir)
        start_update, history, elapsed_before = saved["update"], saved["score_history"], saved["elapsed"]
        if is_main:
            print(f"resumed from {resume_dir} at update {start_update}")
    else:
        # each rank samples with its own seed, so the ranks' completions differ; fixed seed + world size = same run
        # (python's and numpy's generators too, for reward functions that use them)
        torch.manual_seed(args.seed + accelerator.process_index)
        random.seed(args.seed + accelerator.process_index)
        np.random.seed(args.seed + accelerator.process_index)
    metrics_path = os.path.join(args.output_dir, "metrics.jsonl")
    if is_main:  # keep the metrics of the updates the checkpoint holds, drop any written after it
        lines = open(metrics_path).read().splitlines() if (resume_dir and os.path.exists(metrics_path)) else []
        with open(metrics_path, "w") as f:
            f.writelines(line + "\n" for line in lines if json.loads(line)["update"] <= start_update)

    def save_checkpoint(update):
        """Weights, optimizer, RNG of every rank (accelerate's save_state), plus the counters, into
        checkpoint-<update>.tmp, renamed into place once complete: a crash mid-save leaves the last one intact."""
        final = os.path.join(args.output_dir, f"checkpoint-{update}")
        tmp = final + ".tmp"
        if is_main and os.path.exists(tmp):
            shutil.rmtree(tmp)
        accelerator.wait_for_everyone()
        accelerator.save_state(tmp)
        accelerator.wait_for_everyone()
        if is_main:
            state = {"update": update, "world_size": accelerator.num_processes, "args": asdict(args),
                     "score_history": history, "elapsed": elapsed_before + time.perf_counter() - start_time}  # fmt: skip
            with open(os.path.join(tmp, "trainer_state.json"), "w") as f:
                json.dump(state, f)
            if os.path.exists(final):
                shutil.rmtree(final)
            os.replace(tmp, final)
            for old in checkpoint_dirs(args.output_dir)[: -args.save_total_limit] if args.save_total_limit else []:
                shutil.rmtree(old)
        accelerator.wait_for_everyone()

    # preemption: SIGTERM or SIGINT finishes the current update, writes a checkpoint and exits
    stop_signal = []
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda number, frame: stop_signal.append(number))

    def now():
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # time what the GPU did, not what was queued
        return time.perf_counter()

    if is_main:
        print(f"{args.run_name}: {num_updates} updates of {batch_size} completions ({B} prompts x k={args.rloo_k} "
              f"per process, {accelerator.num_processes} processes) -> {args.output_dir}")  # fmt: skip
    start_time = previous_end = now()
    consecutive_skips, skipped_steps = 0, 0
    sample_every = max(1, num_updates // args.num_sample_generations) if args.num_sample_generations > 0 else 0
    print_every = max(1, num_updates // 20)
    phase_totals = {"generation": 0.0, "scoring": 0.0, "training": 0.0, "other": 0.0, "tokens": 0.0}  # this session
    for update in tqdm(range(start_update, num_updates), disable=not is_main, initial=start_update, total=num_updates):
        # linear decay to 0 over exactly num_updates updates
        lr = args.learning_rate * (1.0 - update / num_updates)
        for group in optimizer.param_groups:
            group["lr"] = lr

        # ---- data: one shuffled order per pass over the prompts, the same on every rank, each rank its slice
        batches_per_pass = len(prompts) // (B * accelerator.num_processes)
        order = torch.randperm(len(prompts), generator=torch.Generator().manual_seed(args.seed + update // batches_per_pass))
        start = ((update % batches_per_pass) * accelerator.num_processes + accelerator.process_index) * B
        batch_prompts = [prompts[i] for i in order[start : start + B].tolist()]
        queries, query_mask = pad_left(batch_prompts, tokenizer.pad_token_id)
        # k-major: row i*B + j is sample i of prompt j, the layout rloo_advantages expects
        queries, query_mask = queries.repeat(args.rloo_k, 1).to(device), query_mask.repeat(args.rloo_k, 1).to(device)
        context_length = queries.shape[1]
        t0 = now()

        # ---- 1. rollout: sample k completions per prompt
        policy.eval()  # no dropout anyway; eval lets generation use the KV cache under gradient checkpointing
        gather = zero3 and args.ds3_gather_for_generation
        # ZeRO-3: gather the full weights once for the whole rollout instead of once per forward
        gathered = deepspeed.zero.GatheredParameters(list(policy.parameters())) if gather else contextlib.nullcontext()
        responses = []
        with torch.no_grad(), gathered:
            for i in range(0, len(queries), args.local_rollout_forward_batch_size):
                chunk = slice(i, i + args.local_rollout_forward_batch_size)
                tokens = generate(unwrapped_policy, queries[chunk], query_mask[chunk], args.response_length,
                                  args.temperature, args.stop_token_id, tokenizer.pad_token_id, synced=zero3 and not gather)  # fmt: skip
                responses.append(F.pad(tokens, (0, args.response_length - tokens.shape[1]), value=tokenizer.pad_token_id))
        responses = torch.cat(responses)  # (k*B, response_length)
        # ---- 2. truncate after the stop token; then drop the columns where every completion had stopped
        responses, response_mask = truncate_response(responses, args.stop_token_id, tokenizer.pad_token_id)
        T = int(response_mask.sum(1).max())
        responses, response_mask = responses[:, :T], response_mask[:, :T]  # (k*B, T)
        query_responses = torch.cat([queries, responses], 1)  # (k*B, P + T)
        attention_mask = torch.cat([query_mask, response_mask.long()], 1)
        t1 = now()

        # ---- 3. log-probs under the policy (the "old" log-probs of the update) and under the reference
        chunks = [slice(i, i + args.local_rollout_forward_batch_size) for i in range(0, len(queries), args.local_rollout_forward_batch_size)]
        with torch.no_grad():
            # the policy in micro-batches of the training forward's size, through the same code, so that with one
            # epoch the first ratio is exactly 1
            micro = args.per_device_train_batch_size
            old_logprobs = torch.cat([forward_logprobs(policy, query_responses[i : i + micro], attention_mask[i : i + micro],
                                                       context_length, args.temperature)[0]
                                      for i in range(0, len(queries), micro)])  # (k*B, T)
            with accelerator.autocast():
                ref_logprobs = torch.cat([forward_logprobs(ref_policy, query_responses[rows], attention_mask[rows],
                                                           context_length, args.temperature)[0] for rows in chunks])  # fmt: skip

            # ---- 4. the score: the reward function on the decoded text, or the reward model at the last real token
            if reward_model is None or reward_tokenizer is not None:
                prompt_texts = tokenizer.batch_decode(queries, skip_special_tokens=True)
                completion_texts = tokenizer.batch_decode(responses, skip_special_tokens=True)
            if reward_model is None:
                scores = torch.tensor(check_scores(reward_fn(prompt_texts, completion_texts), len(queries), args.reward_fn),
                                      dtype=torch.float, device=device)  # fmt: skip
            else:
                if reward_tokenizer is None:  # the same vocabulary: the policy's token ids as they are
                    ids, mask, last_index = query_responses, attention_mask, context_length + response_mask.sum(1) - 1
                else:  # another vocabulary: prompt + completion re-encoded, left-padded, so the last token is last
                    encoded = [reward_tokenizer(p + c, add_special_tokens=False)["input_ids"] for p, c in zip(prompt_texts, completion_texts)]
                    ids, mask = (t.to(device) for t in pad_left(encoded, reward_tokenizer.pad_token_id))
                    last_index = torch.full((len(ids),), ids.shape[1] - 1, device=device)
                with accelerator.autocast():
                    scores = torch.cat([get_reward(unwrapped_reward, ids[rows], mask[rows], last_index[rows]) for rows in chunks])  # (k*B,)
        t2 = now()

        # ---- 5. missing-EOS penalty: completions that never produced the stop token lose missing_eos_penalty
        if args.missing_eos_penalty is not None:  # validate_args made sure a stop token is set
            contains_stop = ((responses == args.stop_token_id) & response_mask).any(1)
            scores = scores - args.missing_eos_penalty * (~contains_stop).float()
        raw_scores = scores  # what objective/scores logs: before normalization and clipping
        # ---- 6. normalize (optional, over the global batch) and always clip to [-c, c]
        if args.normalize_reward:
            scores = whiten(scores)
        scores = scores.clamp(-args.reward_clip_range, args.reward_clip_range)

        # ---- 7. KL to the reference, per token, and 8. the leave-one-out advantages
        kl = torch.where(response_mask, old_logprobs - ref_logprobs, 0.0)  # (k*B, T)
        sequence_kl = kl.sum(1)  # (k*B,)
        if args.token_level_kl:
            advantages = token_level_advantages(scores, kl, response_mask, args.kl_coef, args.rloo_k, args.whiten_rewards)
            if args.normalize_advantage:
                advantages = torch.where(response_mask, whiten(advantages, response_mask), 0.0)
        else:
            rewards = scores - args.kl_coef * sequence_kl  # the KL penalty is part of the sequence's reward
            if args.whiten_rewards:
                rewards = whiten(rewards, shift_mean=False)
            advantages = rloo_advantages(rewards, args.rloo_k)  # (k*B,)
            if args.normalize_advantage:
                advantages = whiten(advantages)

        # ---- non-finite guard: a NaN or inf anywhere in the rollout (a reward, a log-prob) skips this update
        finite = torch.isfinite(advantages).all() & torch.isfinite(old_logprobs[response_mask]).all()
        finite = bool(all_reduce_sum((~finite).float()) == 0)  # every rank skips, or none

        # ---- 9. the update: num_ppo_epochs passes, each over num_mini_batches shuffled mini-batches of
        # gradient_accumulation_steps micro-batches, one optimizer step per mini-batch
        policy.train()
        # sums for the metrics, reduced over every rank below; a "term" is a sequence, or a real token in token mode
        sums = dict.fromkeys(["loss", "clipfrac", "approxkl", "ratio", "ratio_sq", "entropy", "terms", "tokens"], 0.0)
        for _ in range(args.num_ppo_epochs if finite else 0):  # no epochs at all when the guard skips the update
            permutation = torch.randperm(local_batch_size, device=device)
            for mini_start in range(0, local_batch_size, mini_batch_size):
                for micro_start in range(mini_start, mini_start + mini_batch_size, args.per_device_train_batch_size):
                    rows = permutation[micro_start : micro_start + args.per_device_train_batch_size]
                    with accelerator.accumulate(policy):
                        new_logprobs, entropy = forward_logprobs(policy, query_responses[rows], attention_mask[rows],
                                                                 context_length, args.temperature, with_entropy=True)  # fmt: skip
                        mask = response_mask[rows]
                        loss, clipfrac = policy_loss(new_logprobs, old_logprobs[rows], advantages[rows], mask, args.cliprange)
                        accelerator.backward(loss)  # under DeepSpeed this also clips and steps at the boundary
                        if accelerator.sync_gradients and not deepspeed_engine:  # the last micro-batch
                            grad_norm = accelerator.clip_grad_norm_(policy.parameters(), args.max_grad_norm)
                            finite_step = math.isfinite(grad_norm)  # one host sync per optimizer step
                            if finite_step or accelerator.scaler is not None:
                                optimizer.step()  # under fp16 the grad scaler itself skips a non-finite step
                            skipped_steps += int(not finite_step)
                            optimizer.zero_grad()
                    with torch.no_grad():
                        ratio_log = log_ratio(new_logprobs, old_logprobs[rows], mask, not args.token_level_kl)
                        term_mask = mask if args.token_level_kl else torch.ones_like(ratio_log, dtype=torch.bool)
                        ratio, terms = ratio_log.exp()[term_mask], term_mask.sum()
                        for name, value in [("loss", loss * terms), ("clipfrac", clipfrac * terms),
                                            ("approxkl", 0.5 * (ratio_log[term_mask] ** 2).sum()), ("ratio", ratio.sum()),
                                            ("ratio_sq", (ratio**2).sum()), ("entropy", entropy[mask].sum()),
                                            ("terms", terms), ("tokens", mask.sum())]:  # fmt: skip
                            sums[name] = sums[name] + value
        if not finite:
            skipped_steps += 1
            consecutive_skips += 1
        else:
            consecutive_skips = 0
        t3 = now()

        # ---- 10. metrics (TRL's names), over real response tokens only: sums over every rank in one all-reduce,
        # which also tells every rank whether any of them got a stop signal
        sums.update(kl=sequence_kl.sum(), neglogp=(-old_logprobs[response_mask]).sum(),
                    scores=raw_scores.sum(), rlhf=(scores - args.kl_coef * sequence_kl).sum(),
                    eos=((responses == tokenizer.eos_token_id) & response_mask).sum(), generated=response_mask.sum(),
                    stop_signals=len(stop_signal))  # fmt: skip
        values = torch.stack([torch.as_tensor(v, dtype=torch.float, device=device) for v in sums.values()])
        totals = dict(zip(sums, all_reduce_sum(values).tolist()))
        n_seq, terms, tokens = batch_size, max(totals["terms"], 1.0), max(totals["tokens"], 1.0)  # completions, terms, tokens
        episode = (update + 1) * batch_size
        mean_ratio = totals["ratio"] / terms
        metrics = {
            "update": update + 1,
            "episode": episode,
            "eps": (episode - start_update * batch_size) / max(time.perf_counter() - start_time, 1e-9),
            "lr": lr,
            "objective/kl": totals["kl"] / n_seq,
            "objective/entropy": totals["neglogp"] / n_seq,  # of the sampled tokens, summed over each completion
            "objective/non_score_reward": -args.kl_coef * totals["kl"] / n_seq,
            "objective/rlhf_reward": totals["rlhf"] / n_seq,
            "objective/scores": totals["scores"] / n_seq,
            "policy/approxkl_avg": totals["approxkl"] / terms,
            "policy/clipfrac_avg": totals["clipfrac"] / terms,
            "loss/policy_avg": totals["loss"] / terms,
            "policy/entropy_avg": totals["entropy"] / tokens,  # of the full distribution, per real token
            "val/ratio": mean_ratio,
            "val/ratio_var": max(totals["ratio_sq"] / terms - mean_ratio**2, 0.0),
            "val/num_eos_tokens": totals["eos"],
            "train/skipped_steps": skipped_steps,
            # where this update's time went; "other" is everything since the previous update's training ended
            # (its metrics, logging and checkpoint, then this update's data)
            "time/generation": t1 - t0,
            "time/scoring": t2 - t1,
            "time/training": t3 - t2,
            "time/other": t0 - previous_end,
            "time/tokens_per_second": totals["generated"] / max(t1 - t0, 1e-9),  # generated, over every rank
            "time/peak_memory_mib": peak_memory_mib(),  # this rank's
        }
        for phase in ("generation", "scoring", "training", "other"):
            phase_totals[phase] += metrics[f"time/{phase}"]
        phase_totals["tokens"] += totals["generated"]
        history.append(metrics["objective/scores"])
        if is_main:
            with open(metrics_path, "a") as f:
                f.write(json.dumps(metrics) + "\n")
            if (update + 1) % print_every == 0 or update == start_update:
                tqdm.write(f"update {update + 1}/{num_updates}  score {metrics['objective/scores']:.3f}  "
                           f"kl {metrics['objective/kl']:.2f}  loss {metrics['loss/policy_avg']:.4f}  "
                           f"clipfrac {metrics['policy/clipfrac_avg']:.2f}  eps {metrics['eps']:.1f}")  # fmt: skip
            if sample_every and (update + 1) % sample_every == 0:
                texts = tokenizer.batch_decode(query_responses[:4, :context_length], skip_special_tokens=True)
                completions = tokenizer.batch_decode(responses[:4], skip_special_tokens=True)
                tqdm.write(f"{'prompt':<32} | {'completion':<60} | score")
                for p, c, s in zip(texts, completions, raw_scores[:4].tolist()):
                    tqdm.write(f"{printable(p, 32):<32} | {printable(c):<60} | {s:.3f}")
        if args.report_to != "none":
            accelerator.log(metrics, step=episode)

        # ---- checkpoints: periodic, on preemption, and when the guard gives up
        stop = totals["stop_signals"] > 0
        too_many_skips = consecutive_skips >= 3
        if (update + 1) % args.save_steps == 0 or update + 1 == num_updates or stop or too_many_skips:
            save_checkpoint(update + 1)
        if too_many_skips:
            raise SystemExit(f"rloo.py: stopped at update {update + 1}: non-finite rewards or log-probs in "
                             f"3 updates in a row (the last good state is in {args.output_dir}/checkpoint-{update + 1}); "
                             "check the reward and lower --learning-rate")  # fmt: skip
        if stop:
            if is_main:
                print(f"rloo.py: preempted; checkpoint written. Resume with: --output-dir {args.output_dir} "
                      "--resume-from-checkpoint latest", file=sys.stderr)  # fmt: skip
            sys.exit(143)
        previous_end = t3

    # ---- save the final policy: a normal save_pretrained directory, loadable on one device
    state_dict = accelerator.get_state_dict(policy)  # under ZeRO-3, gathers the full weights from every rank
    if is_main:
        unwrapped_policy.save_pretrained(args.output_dir, state_dict=state_dict, safe_serialization=True)
        tokenizer.save_pretrained(args.output_dir)
        if args.push_to_hub:
            unwrapped_policy.push_to_hub(args.hub_model_id or args.run_name)
            tokenizer.push_to_hub(args.hub_model_id or args.run_name)
    accelerator.wait_for_everyone()
    accelerator.end_training()
    if is_main and history:
        # the run's own speed report: throughput, where an update's time went, peak memory
        session = max(now() - start_time, 1e-9)
        updates_run = num_updates - start_update
        phases = sum(phase_totals[p] for p in ("generation", "scoring", "training", "other"))
        shares = ", ".join(f"{p} {100 * phase_totals[p] / max(phases, 1e-9):.0f}%" for p in ("generation", "scoring", "training", "other"))
        memory = "peak GPU memory" if torch.cuda.is_available() else "peak RSS"
        print(f"speed: {updates_run * batch_size / session:.1f} episodes/s, "
              f"{phase_totals['tokens'] / max(phase_totals['generation'], 1e-9):.0f} generated tokens/s while generating, "
              f"{phases / max(updates_run, 1):.3f} s/update ({shares}); {memory} {peak_memory_mib():.0f} MiB (rank 0)")  # fmt: skip
        tenth = max(1, len(history) // 10)
        print(f"done in {elapsed_before + session:.0f}s: {num_updates} updates, {num_updates * batch_size} episodes; "
              f"mean score {np.mean(history[:tenth]):.3f} (first tenth) -> {np.mean(history[-tenth:]):.3f} "
              f"(last tenth); model saved to {args.output_dir}")  # fmt: skip


if __name__ == "__main__":
    main(tyro.cli(Args))
