"""Flags, Markdown table and figure of `language_model.py`.

The example's own file holds what it teaches (corpus, model, the first-window
check, training three ways); this module holds its plumbing.
"""

import argparse
import os

import numpy as np

# The default run: about a minute on a two-core CPU.
DEFAULTS = dict(batch_size=8, steps=4, epochs=4, num_sequences=512,
                min_length=3, max_length=64, run_eagerly=False,
                val_sequences=128, embedding_dim=32, num_heads=4, num_blocks=2)
# `--smoke`: a tiny corpus and model, trained eagerly (tracing three graphs
# would take longer than the training).
SMOKE = dict(batch_size=4, steps=2, epochs=1, num_sequences=32, max_length=32,
             run_eagerly=True, val_sequences=16, embedding_dim=16,
             num_heads=2, num_blocks=1)
# `--memory-limit-mb`: one update per batch of 256 sequences, bucketed by
# length; 8 heads, so that attention (quadratic in the length) is a large
# part of the memory of the long buckets.
MEMORY = dict(batch_size=256, steps=1, epochs=2, num_sequences=2048,
              val_sequences=256, num_heads=8, run_eagerly=False)
# `--memory-limit-mb` with `--smoke`: 3 batches' worth of sequences, one
# block, trained in graphs ("auto" needs them). In 26 MiB (the tests') a
# batch of 256 sequences of 16 tokens fits whole and a quarter of a batch of
# 64 tokens does not.
MEMORY_SMOKE = dict(batch_size=256, epochs=1, num_sequences=768,
                    val_sequences=64, max_length=64, embedding_dim=32,
                    num_blocks=1, run_eagerly=False)


def build_parser(description):
    parser = argparse.ArgumentParser(description=description)
    for flag, key, text in [
        ("batch-size", "batch_size", "Micro-batch size B"),
        ("gradient-accumulation-steps", "steps", "Micro-batches per update N"),
        ("epochs", "epochs", "Training epochs per way"),
        ("num-sequences", "num_sequences",
         "Training sequences, rounded down to whole windows of N * B"),
        ("min-length", "min_length", "Fewest words in a sequence"),
        ("max-length", "max_length", "Most words in a sequence"),
    ]:
        parser.add_argument(f"--{flag}", dest=key, metavar=key.upper(),
                            type=int,
                            help=f"{text} (default {DEFAULTS[key]}).")
    parser.add_argument("--learning-rate", type=float, default=3e-3,
                        help="SGD and Adam learning rate (default: 0.003).")
    parser.add_argument("--seed", type=int, default=42,
                        help="Corpus, weights and data order (default: 42).")
    parser.add_argument(
        "--output-dir", default=os.path.join("outputs", "language_model"),
        help="Where the figure and the JSON go (default: %(default)s).")
    parser.add_argument("--smoke", action="store_true",
                        help="Tiny corpus and model: checks that it all runs.")
    parser.add_argument("--run-eagerly", action=argparse.BooleanOptionalAction,
                        help="Train without tracing graphs (default: only "
                        "with --smoke).")
    parser.add_argument("--verbose", type=int, default=0, choices=[0, 1, 2],
                        help="Keras fit verbosity (default: 0; 2 with "
                        "--memory-limit-mb).")
    parser.add_argument(
        "--memory-limit-mb", type=int,
        help="Instead of the comparison: train on batches bucketed by "
        "length with micro_batch_size='auto' in a device of this many MiB "
        "(a logical GPU, or a CPU limit). Changes the defaults to "
        + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in MEMORY.items()
                   if k not in ("steps", "run_eagerly"))
        + " (one update per batch).")
    return parser


def resolve(args):
    """Fills unset settings from DEFAULTS (and SMOKE, MEMORY), and checks
    them."""
    memory = getattr(args, "memory_limit_mb", None)
    settings = {**DEFAULTS, **(SMOKE if args.smoke else {})}
    if memory:
        settings.update(MEMORY, **(MEMORY_SMOKE if args.smoke else {}))
    for key, value in settings.items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    for key in ["batch_size", "epochs", "num_sequences", "min_length"]:
        if getattr(args, key) < 1:
            raise ValueError(f"`--{key.replace('_', '-')}` must be a positive "
                             f"integer. Received: {key}={getattr(args, key)}")
    least = 1 if memory else 2
    if args.steps < least:
        raise ValueError("`--gradient-accumulation-steps` must be at least "
                         f"{least}"
                         + ("" if memory else " (the built-in option's minimum)")
                         + f". Received: gradient_accumulation_steps={args.steps}")
    if args.max_length < args.min_length:
        raise ValueError("`--max-length` must be at least `--min-length`. "
                         f"Received: min_length={args.min_length}, "
                         f"max_length={args.max_length}")
    window = args.batch_size * args.steps
    if args.num_sequences < window:
        raise ValueError("`--num-sequences` must hold one window of "
                         f"batch_size * steps = {window} sequences. "
                         f"Received: num_sequences={args.num_sequences}")
    # Whole windows only: every way makes the same updates.
    args.num_sequences -= args.num_sequences % window
    return args


def labels(args, optimizer="optimizer"):
    """Names of the three ways."""
    n, b = args.steps, args.batch_size
    return {"big_batch": f"big batch, 1 x {n * b}",
            "keras_accum": f"keras_accum, {n} x {b}",
            "builtin": f"built-in {optimizer}(gradient_accumulation_steps="
                       f"{n}), {n} x {b}"}


def markdown_table(differences, args):
    lines = ["| way | SGD update vs big batch | Adam update vs big batch |",
             "|---|---:|---:|"]
    for way, name in labels(args).items():
        lines.append(f"| {name} | {differences['sgd'][way]:.1e} "
                     f"| {differences['adam'][way]:.1e} |")
    return "\n".join(lines)


def plot(runs, args, path):
    """Validation loss per update, and its distance to the big batch's."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = labels(args, "Adam")
    styles = {"big_batch": dict(color="black", linestyle="--"),
              "keras_accum": dict(color="tab:orange", linewidth=4, alpha=0.6),
              "builtin": dict(color="tab:blue")}
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    big = np.array(runs["big_batch"]["val_loss_per_update"])
    for way in ["keras_accum", "builtin", "big_batch"]:
        losses = np.array(runs[way]["val_loss_per_update"])
        axes[0].plot(losses, label=names[way], **styles[way])
        if way != "big_batch":  # Equal losses are drawn at the bottom, 1e-9.
            gap = np.maximum(np.abs(losses - big)[1:], 1e-9)
            axes[1].semilogy(range(1, len(losses)), gap, label=names[way],
                             **{**styles[way], "linewidth": 1.5})
    axes[0].set_ylabel("validation loss (mean over real tokens)")
    axes[1].set_ylabel("|validation loss - big batch's| (0 drawn at 1e-9)")
    axes[1].set_ylim(bottom=5e-10)
    for ax in axes:
        ax.set_xlabel("optimizer update")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"Causal transformer on sequences of {args.min_length} to "
                 f"{args.max_length} words, padded; Adam, float32")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
