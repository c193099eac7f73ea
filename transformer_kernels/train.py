"""Train a seed model on the fused ops: ``python -m transformer_kernels.train --model transformer``.

Trains :class:`~transformer_kernels.models.Transformer` or
:class:`~transformer_kernels.models.ConvSeq2Seq` on a built-in synthetic translation task (or on a
tab-separated parallel text file), shows the loss and tokens/s while it trains, then prints a
summary and greedy-decodes a few held-out examples.  Under ``torchrun --nproc-per-node N`` it
trains with :class:`~torch.nn.parallel.DistributedDataParallel`: every rank draws the same global
batch and trains on its share of the rows, and the loss is normalized by the global number of
target tokens, so a step on N ranks updates the parameters as one process on the whole batch does.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import os
import random
import sys
import time
from typing import Iterator, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ._checks import machine_device
from ._progress import Progress
from .models import ConvSeq2Seq, Transformer

PAD, BOS, EOS, UNK = 0, 1, 2, 3
SPECIALS = ("<pad>", "<bos>", "<eos>", "<unk>")


class ConfigError(ValueError):
    """A configuration or data file the run cannot take: the command prints its message, not a
    traceback."""


# Model sizes: "seed" is the seed notebooks' configuration (the models' defaults).
PRESETS = {
    "transformer": {
        "tiny": dict(d_model=32, nhead=2, num_encoder_layers=1, num_decoder_layers=1, dim_feedforward=64),
        "small": dict(d_model=128, nhead=4, num_encoder_layers=2, num_decoder_layers=2, dim_feedforward=256),
        "seed": dict(),
    },
    "convs2s": {
        "tiny": dict(emb_dim=16, hid_dim=32, num_encoder_layers=1, num_decoder_layers=1),
        "small": dict(emb_dim=64, hid_dim=128, num_encoder_layers=4, num_decoder_layers=4),
        "seed": dict(),
    },
}


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    model: str = "transformer"
    impl: str = "fused"
    preset: str = "small"
    steps: int = 200
    batch_size: int = 64
    lr: float = 1e-3
    dropout: Optional[float] = None  # None: the model's default
    data: Optional[str] = None
    device: Optional[str] = None
    dtype: str = "float32"
    compile: bool = False
    seed: int = 0
    examples: int = 4


# ---------------------------------------------------------------------------------------------
# Data: pairs of token-id lists, without bos/eos.


class Vocabulary:
    """Token strings <-> ids, the four specials first."""

    def __init__(self, tokens: Sequence[str]) -> None:
        self.itos = list(SPECIALS) + sorted(set(tokens) - set(SPECIALS))
        self.stoi = {token: index for index, token in enumerate(self.itos)}

    def __len__(self) -> int:
        return len(self.itos)

    def encode(self, words: Sequence[str]) -> list[int]:
        return [self.stoi.get(word, UNK) for word in words]

    def decode(self, ids: Sequence[int]) -> str:
        return " ".join(self.itos[i] for i in ids if i not in (PAD, BOS, EOS))


@dataclasses.dataclass
class Corpus:
    train: list[tuple[list[int], list[int]]]
    held_out: list[tuple[list[int], list[int]]]
    source_vocab: Vocabulary
    target_vocab: Vocabulary


def synthetic_corpus(
    size: int = 20000, held_out: int = 64, *, words: int = 32, lengths=(8, 40), seed: int = 0
) -> Corpus:
    """A toy "translation": each source word mapped through a fixed substitution.  It needs the
    attention to follow the source position by position and has one right answer, so exact-match
    accuracy of the decoded examples tells whether the model learned it."""
    rng = random.Random(seed)
    source_words = [f"s{i}" for i in range(words)]
    target_words = [f"t{i}" for i in range(words)]
    rng.shuffle(target_words)
    translation = dict(zip(source_words, target_words))
    pairs = []
    for _ in range(size + held_out):
        sentence = [rng.choice(source_words) for _ in range(rng.randint(*lengths))]
        pairs.append((sentence, [translation[w] for w in sentence]))
    return _encode(pairs, held_out)


def tsv_corpus(path: str, held_out: int = 64) -> Corpus:
    """``source<TAB>target`` per line, whitespace-tokenized; the last ``held_out`` lines are held out."""
    try:
        with open(path, encoding="utf-8") as file:
            text = file.read()
    except UnicodeDecodeError as error:
        raise ConfigError(f"{path}: not UTF-8 text ({error.reason} at byte {error.start})") from None
    pairs = []
    for number, line in enumerate(text.split("\n"), 1):
        if not line.strip():
            continue
        columns = line.split("\t")
        if len(columns) != 2:
            raise ConfigError(f"{path}:{number}: expected 'source<TAB>target', got {len(columns)} columns")
        source, target = columns[0].split(), columns[1].split()
        if not source:  # the models take sources of at least one token
            raise ConfigError(f"{path}:{number}: the source (before the tab) has no token")
        pairs.append((source, target))
    if len(pairs) <= held_out:
        raise ConfigError(f"{path}: {len(pairs)} sentence pairs; need more than the {held_out} held out")
    return _encode(pairs, held_out)


def _encode(pairs, held_out: int) -> Corpus:
    train = pairs[:-held_out]
    source_vocab = Vocabulary([w for s, _ in train for w in s])
    target_vocab = Vocabulary([w for _, t in train for w in t])
    encoded = [(source_vocab.encode(s), target_vocab.encode(t)) for s, t in pairs]
    return Corpus(encoded[:-held_out], encoded[-held_out:], source_vocab, target_vocab)


def pad_batch(pairs, device) -> tuple[torch.Tensor, torch.Tensor]:
    """``src [B, S]`` and ``tgt [B, T]`` (``bos ... eos``), right-padded with ``PAD``."""
    sources = [s for s, _ in pairs]
    targets = [[BOS, *t, EOS] for _, t in pairs]

    def pad(rows):
        width = max(map(len, rows))
        return torch.tensor([row + [PAD] * (width - len(row)) for row in rows], dtype=torch.long, device=device)

    return pad(sources), pad(targets)


def batches(corpus: Corpus, batch_size: int, seed: int) -> Iterator[list]:
    """Global batches drawn the same way on every rank (same seed)."""
    rng = random.Random(seed)
    while True:
        yield rng.sample(corpus.train, batch_size)


# ---------------------------------------------------------------------------------------------
# Model and step.


def build_model(config: TrainConfig, corpus: Corpus) -> torch.nn.Module:
    if config.model not in PRESETS:
        raise ConfigError(f"model must be one of {sorted(PRESETS)}, got {config.model!r}")
    if config.preset not in PRESETS[config.model]:
        raise ConfigError(f"preset must be one of {sorted(PRESETS[config.model])}, got {config.preset!r}")
    kwargs = dict(PRESETS[config.model][config.preset], pad_index=PAD, impl=config.impl)
    if config.dropout is not None:
        kwargs["dropout"] = config.dropout
    longest = max(max(len(s), len(t) + 2) for s, t in corpus.train + corpus.held_out)
    kwargs["max_len"] = max(longest + 16, 100)  # room for the decoded examples' extra steps
    model_class = Transformer if config.model == "transformer" else ConvSeq2Seq
    return model_class(len(corpus.source_vocab), len(corpus.target_vocab), **kwargs)


def logits_of(model: torch.nn.Module, src: torch.Tensor, tgt_in: torch.Tensor) -> torch.Tensor:
    output = model(src, tgt_in)
    return output[0] if isinstance(output, tuple) else output  # ConvSeq2Seq also returns attention


def train_step(model, optimizer, scaler, src, tgt, *, total_tokens: int, world_size: int, autocast) -> float:
    """One optimizer step on this rank's rows; returns this rank's share of the summed loss.

    The loss is summed over this rank's target tokens and divided by the tokens of the whole
    global batch, times ``world_size`` because DistributedDataParallel averages the ranks'
    gradients: the update is then that of the token-mean loss over the global batch."""
    tgt_in, tgt_out = tgt[:, :-1], tgt[:, 1:]
    with autocast():
        logits = logits_of(model, src, tgt_in)
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # the loss of autocast logits in float32
    loss_sum = F.cross_entropy(logits.flatten(0, 1), tgt_out.flatten(), ignore_index=PAD, reduction="sum")
    optimizer.zero_grad(set_to_none=True)
    scaler.scale(loss_sum * (world_size / total_tokens)).backward()
    scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    scaler.step(optimizer)
    scaler.update()
    return loss_sum.item() / total_tokens


# ---------------------------------------------------------------------------------------------
# The command.


def _autocast_for(device: torch.device, dtype: str):
    if dtype == "float32":
        return contextlib.nullcontext
    return lambda: torch.autocast(device.type, dtype=getattr(torch, dtype))


def train(config: TrainConfig) -> dict:
    """Run the training; returns the summary printed at the end (and the trained model)."""
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    device = torch.device(config.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if distributed:
        rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        if device.type == "cuda":
            local_rank = int(os.environ.get("LOCAL_RANK", "0"))
            if local_rank >= torch.cuda.device_count():
                raise ConfigError(f"LOCAL_RANK={local_rank}, but only {torch.cuda.device_count()} CUDA device(s) are "
                                  "visible: run one process per GPU, or train on the CPU (--device cpu)")
            device = torch.device("cuda", local_rank)
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    else:
        rank, world_size = 0, 1
    if config.batch_size % world_size:
        raise ConfigError(f"batch_size ({config.batch_size}) must be a multiple of the world size ({world_size})")
    if config.dtype not in ("float32", "bfloat16", "float16"):
        raise ConfigError(f"dtype must be float32, bfloat16 or float16, got {config.dtype!r}")
    torch.manual_seed(config.seed)
    corpus = tsv_corpus(config.data) if config.data is not None else synthetic_corpus(seed=config.seed)
    if config.batch_size > len(corpus.train):
        raise ConfigError(f"batch_size ({config.batch_size}) exceeds the {len(corpus.train)} training pairs "
                          "(batches draw distinct pairs)")
    model = build_model(config, corpus).to(device)
    trained = model
    if distributed:
        device_ids = [device.index] if device.type == "cuda" else None
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=device_ids)
    step_model = torch.compile(model) if config.compile else model
    optimizer = torch.optim.Adam(trained.parameters(), lr=config.lr, betas=(0.9, 0.98))
    autocast = _autocast_for(device, config.dtype)
    # float16 gradients underflow without loss scaling; a disabled scaler passes everything through.
    scaler = torch.amp.GradScaler(device.type, enabled=config.dtype == "float16")

    is_main = rank == 0
    if is_main:
        parameters = sum(p.numel() for p in trained.parameters())
        print(f"{config.model} ({config.impl}, preset {config.preset}, {parameters / 1e6:.2f}M parameters) on "
              f"{device} x{world_size}, {config.dtype}, {len(corpus.train)} training pairs", flush=True)
    progress = Progress(config.steps, desc="training", unit="step", every=config.steps // 20, enabled=is_main)
    losses, tokens_seen, elapsed = [], 0, 0.0
    rows = config.batch_size // world_size
    loss_sum = torch.zeros(1, device=device)  # one tensor for every step's all-reduce: see _leave_process_group
    for _, pairs in zip(range(config.steps), batches(corpus, config.batch_size, config.seed)):
        total_tokens = sum(len(t) + 1 for _, t in pairs)  # targets predicted: the words and eos
        src, tgt = pad_batch(pairs[rank * rows:(rank + 1) * rows], device)
        start = time.perf_counter()
        loss = train_step(step_model, optimizer, scaler, src, tgt, total_tokens=total_tokens, world_size=world_size,
                          autocast=autocast)
        if distributed:
            loss_sum.fill_(loss)
            dist.all_reduce(loss_sum)
            loss = float(loss_sum)
        elapsed += time.perf_counter() - start
        tokens_seen += total_tokens
        losses.append(loss)
        progress.begin(f"loss={loss:.3f} tokens/s={tokens_seen / elapsed:,.0f}")  # shows the step just done
        progress.end()
    progress.close()

    summary = {"first_loss": losses[0], "final_loss": losses[-1], "tokens_per_s": tokens_seen / elapsed,
               "model": trained}
    if is_main:
        print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f}; {tokens_seen:,} target tokens in {elapsed:.1f} s "
              f"({summary['tokens_per_s']:,.0f} tokens/s)")
        summary["examples"] = _decode_examples(trained, corpus, config.examples, device)
    if distributed:
        _leave_process_group(loss_sum)
    return summary


def _leave_process_group(reduced: torch.Tensor, wait_s: float = 30.0, settle_s: float = 0.25) -> None:
    """Destroy the process group once its communication threads hold no Python object.

    A gloo worker thread drops a finished collective's work under the group's lock, and takes the
    GIL to do so when the work holds a Python object: a tensor Python made, or the thread-local
    state captured where the work was made (autograd stashes a Python context there during the
    backward, when DistributedDataParallel all-reduces the gradients). The group's destructor, run
    where its last reference goes (here, or with the DistributedDataParallel wrapper), waits for
    that lock and those threads while it holds the GIL: a deadlock, seen under load as a hang at
    exit (``~ProcessGroupGloo`` against ``~AsyncWork``). Nothing public tells when a thread is idle.
    So wait, with the GIL released, until the tensor every step reduced is ours alone (its work is
    gone, and with it the work of the thread that ran it), then ``settle_s`` more for a thread that
    finished a gradient all-reduce but was not scheduled since."""
    deadline = time.monotonic() + wait_s
    while reduced._use_count() > 1 and time.monotonic() < deadline:
        time.sleep(0.001)
    time.sleep(settle_s)
    dist.destroy_process_group()


def _decode_examples(model, corpus: Corpus, count: int, device) -> list[tuple[str, str, str]]:
    """Greedy-decode ``count`` held-out sources and print them beside their references."""
    if count <= 0:
        return []
    model.eval()
    pairs = corpus.held_out[:count]
    src, _ = pad_batch(pairs, device)
    longest = max(len(t) for _, t in pairs) + 2
    hypotheses = model.generate(src, max_len=longest + 8, bos_index=BOS, eos_index=EOS)
    model.train()
    examples, correct = [], 0
    for (source, reference), hypothesis in zip(pairs, hypotheses.tolist()):
        text = corpus.target_vocab.decode(hypothesis)
        reference_text = corpus.target_vocab.decode(reference)
        correct += text == reference_text
        examples.append((corpus.source_vocab.decode(source), reference_text, text))
        print(f"  source:    {examples[-1][0]}\n  reference: {reference_text}\n  greedy:    {text}")
    print(f"exact match: {correct}/{len(pairs)}")
    return examples


def parse_args(argv: Optional[Sequence[str]] = None) -> TrainConfig:
    parser = argparse.ArgumentParser(prog="python -m transformer_kernels.train", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(PRESETS), default="transformer")
    parser.add_argument("--impl", choices=("fused", "reference"), default="fused",
                        help="fused: our ops; reference: the seeds' naive math (same parameters)")
    parser.add_argument("--preset", choices=("tiny", "small", "seed"), default="small",
                        help="model size; 'seed' is the seed notebooks' configuration (default: small)")
    parser.add_argument("--steps", type=int, default=TrainConfig.steps)
    parser.add_argument("--batch-size", type=int, default=TrainConfig.batch_size,
                        help="sentence pairs per step, over all ranks together")
    parser.add_argument("--lr", type=float, default=TrainConfig.lr)
    parser.add_argument("--dropout", type=float, default=None, help="default: the model's")
    parser.add_argument("--data", help="a 'source<TAB>target' file (default: the synthetic task)")
    parser.add_argument("--device", help="default: cuda if available, else cpu")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32",
                        help="autocast dtype of the forward (parameters stay float32)")
    parser.add_argument("--compile", action="store_true", help="torch.compile the model")
    parser.add_argument("--seed", type=int, default=TrainConfig.seed)
    parser.add_argument("--examples", type=int, default=TrainConfig.examples,
                        help="held-out sources decoded at the end")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.batch_size < 1:
        parser.error("--steps and --batch-size must be positive")
    if not 0 < args.lr < math.inf:
        parser.error(f"--lr must be positive and finite, got {args.lr}")
    if not -2**63 <= args.seed < 2**64:  # what torch.manual_seed takes
        parser.error(f"--seed must be in [-2**63, 2**64), got {args.seed}")
    if args.dropout is not None and not 0 <= args.dropout < 1:
        parser.error(f"--dropout must be in [0, 1), got {args.dropout}")
    if args.examples < 0:
        parser.error(f"--examples must be 0 or more, got {args.examples}")
    if args.device is not None:
        try:
            machine_device(args.device)
        except ValueError as error:
            parser.error(f"--device: {error}")
    return TrainConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig)})


def main(argv: Optional[Sequence[str]] = None) -> int:
    config = parse_args(argv)
    try:
        train(config)
    except (ConfigError, OSError) as error:  # a data file missing or unreadable, as argparse reports its errors
        print(f"transformer_kernels.train: error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
