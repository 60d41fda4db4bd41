"""
Title: A causal language model with exact gradient accumulation
Description: Train a small transformer on padded text of very different
lengths, where every micro-batch holds a different number of real tokens.

## Introduction

Language-model batches are ragged: sequences of 3 to 64 words are padded to
one length, and the next-token loss, `SparseCategoricalCrossentropy(
ignore_class=0)`, averages over the real tokens only. One batch of `N * B`
sequences divides its summed token losses by the real tokens of all of them.

* `keras_accum.GradientAccumulationModel` weights each micro-batch's gradient
  by its number of real tokens: its update is the big batch's, to rounding.
* Keras' built-in `optimizer(gradient_accumulation_steps=N)` averages the `N`
  micro-batch means: a token in a micro-batch of short sequences counts more
  than one in a micro-batch of long sequences. Its update is another one,
  unless every micro-batch holds as many real tokens (`--min-length 64`).

## Data and model

A toy grammar with subject-verb agreement ("two cats see", "a cat sees")
generates the corpus offline, deterministically from `--seed`, in sequences
of 3 to 64 words (log-uniform: many short, some long). Id 0 pads, id 1 starts
every sequence.

The model: two pre-norm blocks of causal `MultiHeadAttention` and a
feed-forward network, width 32, no dropout (its random masks would differ
between the runs). Padding always follows the real tokens, so the causal mask
alone keeps it out of their context. The output layer reuses the token
embedding matrix (weight tying, as in GPT-2), which makes that matrix's
gradient dense. An untied `Embedding` gets an `IndexedSlices` gradient, whose
repeated rows Keras' Adam squares one by one in its second moment, so a plain
`keras.Model` would not apply Adam to the big batch's gradient.

## What the script does

1. From the same initial weights, it measures the first window's update
   three ways, in float64: a plain `keras.Model` on one batch of `N * B`
   sequences (the reference), `GradientAccumulationModel` on `N` micro-batches
   of `B`, and a plain `keras.Model` whose optimizer has
   `gradient_accumulation_steps=N`, on the same micro-batches; once with SGD,
   whose update is the gradient, and once with Adam. It prints
   `|update - update_big| / |update_big|` for each.
2. It trains the three ways with Adam for a few epochs in float32, from the
   same weights in the same data order, and records the validation loss
   after every update.

## Running it

```
python examples/language_model.py
python examples/language_model.py --batch-size 4 --gradient-accumulation-steps 8
python examples/language_model.py --min-length 64   # equal lengths
python examples/language_model.py --smoke           # tiny, a few seconds
```

It writes `language_model.png` (validation loss per update, and its distance
to the big batch's) and `language_model.json` to `--output-dir`. The default
run takes a minute or so on a two-core CPU.
"""

import contextlib
import json
import os
import sys
import time

import keras
import numpy as np
import tensorflow as tf
from keras import layers, ops

import keras_accum

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import example_utils as utils  # noqa: E402
import language_model_utils as lm_utils  # noqa: E402  (flags, figure)

AUTOTUNE = tf.data.AUTOTUNE
PAD, BOS = 0, 1  # Token ids: padding (ignored by the loss), sequence start.
WAYS = ["big_batch", "keras_accum", "builtin"]
OPTIMIZERS = {"adam": keras.optimizers.Adam, "sgd": keras.optimizers.SGD}

# ---------------------------------------------------------------------------
# Corpus and pipeline
# ---------------------------------------------------------------------------

ADJECTIVES = ["small", "big", "red", "old", "quiet", "clever"]
NOUNS = ["cat", "dog", "bird", "robot", "farmer", "teacher"]
VERBS = ["see", "chase", "like", "follow", "find", "help"]


def noun_phrase(rng, plural):
    pick = lambda options: options[rng.integers(len(options))]  # noqa: E731
    words = [pick(["the", "some", "two"] if plural else ["the", "a", "one"])]
    if rng.random() < 0.5:
        words.append(pick(ADJECTIVES))
    words.append(pick(NOUNS) + ("s" if plural else ""))
    if rng.random() < 0.25:
        words += [pick(["near", "behind", "with"]), "the", pick(NOUNS)]
    return words


def sentence(rng):
    """`subject verb object [and subject verb object] .`, verbs agreeing."""
    words = []
    for clause in range(1 + (rng.random() < 0.3)):
        plural = bool(rng.random() < 0.5)
        verb = VERBS[rng.integers(len(VERBS))]
        words += (["and"] if clause else []) + noun_phrase(rng, plural)
        words += [verb if plural else verb + "s"]
        words += noun_phrase(rng, bool(rng.random() < 0.5))
    return words + ["."]


def make_corpus(num_sequences, min_length, max_length, seed):
    """Word sequences with log-uniform lengths: many short, some long."""
    rng = np.random.default_rng(seed)
    lengths = np.exp(rng.uniform(
        np.log(min_length), np.log(max_length + 1), num_sequences))
    corpus = []
    for length in np.clip(lengths.astype(int), min_length, max_length):
        words = []
        while len(words) < length:
            words += sentence(rng)
        corpus.append(words[:length])
    return corpus


def tokenize(corpus, max_length):
    """Vocabulary and `(num_sequences, max_length + 1)` int32 ids, BOS first."""
    vocabulary = ["[pad]", "[bos]"] + sorted({w for s in corpus for w in s})
    ids = {word: i for i, word in enumerate(vocabulary)}
    tokens = np.full((len(corpus), max_length + 1), PAD, dtype=np.int32)
    for row, words in enumerate(corpus):
        tokens[row, : len(words) + 1] = [BOS] + [ids[w] for w in words]
    return vocabulary, tokens


def inputs_and_targets(tokens):
    """Next-token prediction: the targets are the inputs shifted by one."""
    return tokens[..., :-1], tokens[..., 1:]


def make_dataset(tokens, batch_size, seed):
    """Shuffled with a fixed seed *before* batching: a batch of `N * B` is
    exactly the next `N` micro-batches of `B`, in every epoch of every run."""
    ds = tf.data.Dataset.from_tensor_slices(tokens)
    ds = ds.shuffle(len(tokens), seed=seed, reshuffle_each_iteration=True)
    ds = ds.batch(batch_size)
    return ds.map(inputs_and_targets, num_parallel_calls=AUTOTUNE).prefetch(
        AUTOTUNE)


# ---------------------------------------------------------------------------
# Model
# ---------------------------------------------------------------------------


class TokenAndPositionEmbedding(layers.Layer):
    """Token plus position embedding; with `reverse=True`, token logits from
    the same matrix (weight tying)."""

    def __init__(self, vocab_size, length, dim, **kwargs):
        super().__init__(**kwargs)
        self.token_embedding = layers.Embedding(vocab_size, dim)
        self.position_embedding = layers.Embedding(length, dim)

    def call(self, inputs, reverse=False):
        if reverse:
            return ops.matmul(
                inputs, ops.transpose(self.token_embedding.embeddings))
        positions = ops.arange(ops.shape(inputs)[-1])
        return self.token_embedding(inputs) + self.position_embedding(
            positions)


def transformer_block(x, dim, heads):
    h = layers.LayerNormalization()(x)
    h = layers.MultiHeadAttention(heads, dim // heads)(
        h, h, use_causal_mask=True)
    x = layers.Add()([x, h])
    h = layers.LayerNormalization()(x)
    h = layers.Dense(4 * dim, activation="gelu")(h)
    return layers.Add()([x, layers.Dense(dim)(h)])


def build_model(way, args, vocab_size):
    """The same layers for every way; `keras_accum` accumulates in the model."""
    tokens = keras.Input((args.max_length,), dtype="int32", name="tokens")
    embedding = TokenAndPositionEmbedding(
        vocab_size, args.max_length, args.embedding_dim)
    x = embedding(tokens)
    for _ in range(args.num_blocks):
        x = transformer_block(x, args.embedding_dim, args.num_heads)
    logits = embedding(layers.LayerNormalization()(x), reverse=True)
    if way == "keras_accum":
        return keras_accum.GradientAccumulationModel(
            tokens, logits, gradient_accumulation_steps=args.steps)
    return keras.Model(tokens, logits)


def compile_model(model, way, args, optimizer="adam", run_eagerly=False):
    optimizer = OPTIMIZERS[optimizer](
        args.learning_rate,
        # The built-in option accumulates in the optimizer.
        gradient_accumulation_steps=args.steps if way == "builtin" else None,
    )
    model.compile(
        optimizer=optimizer,
        # The mean over the real tokens: padding (id 0) is left out.
        loss=keras.losses.SparseCategoricalCrossentropy(
            from_logits=True, ignore_class=PAD),
        run_eagerly=run_eagerly,
    )


def batch_size(way, args):
    return args.batch_size * (args.steps if way == "big_batch" else 1)


def flat(weights):
    """Weights (variables or arrays) as one vector."""
    return np.concatenate([np.ravel(np.asarray(w)) for w in weights])


# ---------------------------------------------------------------------------
# The first window, in float64
# ---------------------------------------------------------------------------


@contextlib.contextmanager
def float64():
    floatx, policy = keras.config.floatx(), keras.config.dtype_policy()
    keras.config.set_floatx("float64")
    keras.config.set_dtype_policy("float64")
    try:
        yield
    finally:
        keras.config.set_floatx(floatx)
        keras.config.set_dtype_policy(policy)


def first_window_differences(args, vocab_size, initial, tokens, optimizer):
    """`|update - update_big| / |update_big|` of each way's first window."""
    x, y = inputs_and_targets(tokens[: args.batch_size * args.steps])
    updates = {}
    with float64():
        for way in WAYS:
            model = build_model(way, args, vocab_size)
            model.set_weights([w.astype("float64") for w in initial])
            # Eagerly: a few steps do not repay tracing a graph.
            compile_model(model, way, args, optimizer, run_eagerly=True)
            before = flat(model.trainable_weights)
            model.fit(x, y, batch_size=batch_size(way, args), shuffle=False,
                      verbose=0)
            updates[way] = flat(model.trainable_weights) - before
    big = updates["big_batch"]
    return {way: float(np.linalg.norm(updates[way] - big) / np.linalg.norm(big))
            for way in WAYS}


# ---------------------------------------------------------------------------
# Training three ways
# ---------------------------------------------------------------------------


class LossAfterEachUpdate(keras.callbacks.Callback):
    """Validation loss at the start and after every update; also how far the
    weights at the start of training are from `initial`."""

    def __init__(self, x, y, micro_batches_per_update, initial):
        super().__init__()
        self.x, self.y, self.initial = x, y, flat(initial)
        self.micro_batches_per_update = micro_batches_per_update
        self.loss = keras.losses.SparseCategoricalCrossentropy(
            from_logits=True, ignore_class=PAD)

    def on_train_begin(self, logs=None):
        def validation_loss():
            return self.loss(self.y, self.model(self.x, training=False))

        self.validation_loss = (validation_loss if self.model.run_eagerly
                                else tf.function(validation_loss))
        self.start_gap = float(np.max(np.abs(
            flat(self.model.weights) - self.initial)))
        self.losses, self.micro_batches = [float(self.validation_loss())], 0

    def on_train_batch_end(self, batch, logs=None):
        self.micro_batches += 1
        if self.micro_batches % self.micro_batches_per_update == 0:
            self.losses.append(float(self.validation_loss()))


def train(way, args, vocab_size, initial, train_tokens, val_tokens):
    model = build_model(way, args, vocab_size)
    model.set_weights(initial)
    compile_model(model, way, args, run_eagerly=args.run_eagerly)
    recorder = LossAfterEachUpdate(
        *inputs_and_targets(val_tokens),
        1 if way == "big_batch" else args.steps, initial)
    start = time.perf_counter()
    history = model.fit(
        make_dataset(train_tokens, batch_size(way, args), args.seed),
        epochs=args.epochs, callbacks=[recorder], verbose=args.verbose,
        shuffle=False,  # The pipeline shuffles, with a fixed seed.
    ).history
    return {
        "batch_size": batch_size(way, args),
        "updates": len(recorder.losses) - 1,
        "val_loss_per_update": recorder.losses,
        # `fit()`'s epoch loss: the mean of the batches' token means, weighted
        # by sequences, so it depends on the batch size (the weights do not).
        "train_loss_per_epoch": [float(v) for v in history["loss"]],
        "initial_weights_max_difference": recorder.start_gap,
        "train_seconds": time.perf_counter() - start,
    }


def main(argv=None):
    start = time.perf_counter()
    parser = lm_utils.build_parser(utils.docstring_title(__doc__))
    args = lm_utils.resolve(parser.parse_args(argv))
    os.makedirs(args.output_dir, exist_ok=True)
    keras.utils.set_random_seed(args.seed)

    corpus = make_corpus(args.num_sequences + args.val_sequences,
                         args.min_length, args.max_length, args.seed)
    vocabulary, tokens = tokenize(corpus, args.max_length)
    train_tokens, val_tokens = np.split(tokens, [args.num_sequences])
    words = (train_tokens[:, 1:] != PAD).sum(axis=1)
    first = words[: args.steps * args.batch_size].reshape(args.steps, -1)
    print(f"{len(vocabulary)} tokens in the vocabulary, {len(words)} training "
          f"sequences of {words.min()} to {words.max()} words (mean "
          f"{words.mean():.1f}), e.g. \"{' '.join(corpus[0][:12])} ...\"\n"
          f"Real tokens in the first window's micro-batches: "
          f"{first.sum(axis=1).tolist()}")

    # Every way, in both checks, starts from these weights.
    initial = build_model("big_batch", args, len(vocabulary)).get_weights()
    differences = {
        optimizer: first_window_differences(
            args, len(vocabulary), initial, train_tokens, optimizer)
        for optimizer in ["sgd", "adam"]}
    table = lm_utils.markdown_table(differences, args)
    print("\nFirst window, relative difference of the total weight update to "
          f"the big batch's (float64):\n\n{table}\n")

    runs = {}
    for way in WAYS:
        print(f"Training: {lm_utils.labels(args, 'Adam')[way]} ...",
              flush=True)
        runs[way] = train(way, args, len(vocabulary), initial, train_tokens,
                          val_tokens)
        print(f"  {runs[way]['updates']} updates, final validation loss "
              f"{runs[way]['val_loss_per_update'][-1]:.4f}")

    figure = lm_utils.plot(
        runs, args, os.path.join(args.output_dir, "language_model.png"))
    results = {
        "first_window_update_difference": differences,
        "first_window_real_tokens_per_micro_batch": first.sum(axis=1).tolist(),
        "initial_weights_max_difference": max(
            run["initial_weights_max_difference"] for run in runs.values()),
        "runs": runs,
        "vocabulary": vocabulary,
        "args": vars(args),
        "wall_time_s": time.perf_counter() - start,
    }
    numbers = os.path.join(args.output_dir, "language_model.json")
    with open(numbers, "w") as f:
        json.dump(results, f, indent=2)
    print(f"Wrote figure: {figure}\nWrote numbers: {numbers}\n"
          f"Wall time: {results['wall_time_s']:.1f} s")
    return {**results, "table": table, "figure": figure, "json": numbers}


if __name__ == "__main__":
    main()
