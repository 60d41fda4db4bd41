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

## Training in small memory

With `--memory-limit-mb 48` the script does something else: it trains one
model with `micro_batch_size="auto"` on batches of 256 sequences that a
`tf.data` pipeline groups by length (`bucket_by_sequence_length`: buckets of
16, 32 and 64 tokens), each batch one update, in a device of 48 MiB (on a
CPU the script runs itself again with TensorFlow's CPU allocator limited;
on a GPU it makes a logical device). The model takes sequences of any
length (`keras.Input((None,))`), so every bucket is an input shape of its
own, and "auto" chooses a micro-batch per shape: the first batch, of short
sequences, fits whole; a bucket that comes later starts from that size
scaled by the tokens per row. Attention's memory grows with the square of
the length, so for the longest bucket that guess is too big: the step runs
out of memory in the middle of the epoch, is rolled back, and the same
batch is trained again with micro-batches half as large. The run prints
`fit()`'s messages, the steps that were trained again and the peak memory.

## Running it

```
python examples/language_model.py
python examples/language_model.py --batch-size 4 --gradient-accumulation-steps 8
python examples/language_model.py --min-length 64   # equal lengths
python examples/language_model.py --smoke           # tiny, a few seconds
python examples/language_model.py --memory-limit-mb 48   # bucketed, 48 MiB
python examples/language_model.py --backup-dir backups/lm  # resumable
```

With `--backup-dir DIR`, keras_accum's way is backed up to `DIR` every
`--save-freq` micro-batches (default 50) and at the end of every epoch
(`keras_accum.callbacks.BackupAndRestore`), and each way that has finished
is kept there: killed, the same command run again goes on where it stopped
and writes the numbers of an uninterrupted run. The plain `keras.Model`
ways, which keras_accum's callback does not back up, start again from
their first batch.

It writes `language_model.png` (validation loss per update, and its distance
to the big batch's) and `language_model.json` to `--output-dir`. The default
run takes a minute or so on a two-core CPU. With `--memory-limit-mb` it
writes `language_model_memory.json` instead (less than a minute).
"""

import contextlib
import json
import os
import shutil
import sys
import time

import keras
import numpy as np
import tensorflow as tf
from keras import layers
from keras import ops

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
    """The same layers for every way; `keras_accum` accumulates in the model.

    `way="auto"`: sequences of any length up to `max_length`, each batch
    split into micro-batches that fit (`micro_batch_size="auto"`).
    """
    length = None if way == "auto" else args.max_length
    tokens = keras.Input((length,), dtype="int32", name="tokens")
    embedding = TokenAndPositionEmbedding(
        vocab_size, args.max_length, args.embedding_dim)
    x = embedding(tokens)
    for _ in range(args.num_blocks):
        x = transformer_block(x, args.embedding_dim, args.num_heads)
    logits = embedding(layers.LayerNormalization()(x), reverse=True)
    if way == "keras_accum":
        return keras_accum.GradientAccumulationModel(
            tokens, logits, gradient_accumulation_steps=args.steps)
    if way == "auto":
        return keras_accum.GradientAccumulationModel(
            tokens, logits, gradient_accumulation_steps=args.steps,
            micro_batch_size="auto")
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
    weights at the start of training are from `initial`.

    With `path` (`--backup-dir`), it keeps what it recorded in that JSON
    file. Listed after `BackupAndRestore`, it finds the weights and the
    optimizer restored at a restart, and goes on from the losses of the
    updates the backup had made (the model's `optimizer.iterations`: a
    `GradientAccumulationModel` counts its updates there, and the batches
    that a restart skips make none).
    """

    def __init__(self, x, y, micro_batches_per_update, initial, path=None):
        super().__init__()
        self.x, self.y, self.initial = x, y, flat(initial)
        self.micro_batches_per_update = micro_batches_per_update
        self.path = path
        self.loss = keras.losses.SparseCategoricalCrossentropy(
            from_logits=True, ignore_class=PAD)

    def updates(self):
        if isinstance(self.model, keras_accum.GradientAccumulationModel):
            return int(self.model.optimizer.iterations.numpy())
        return self.micro_batches // self.micro_batches_per_update

    def on_train_begin(self, logs=None):
        def validation_loss():
            return self.loss(self.y, self.model(self.x, training=False))

        self.validation_loss = (validation_loss if self.model.run_eagerly
                                else tf.function(validation_loss))
        self.micro_batches = 0
        if self.path and os.path.exists(self.path):  # Resumed.
            with open(self.path) as f:
                saved = json.load(f)
            self.start_gap = saved["start_gap"]
            self.losses = saved["losses"][: self.updates() + 1]
            return
        self.start_gap = float(np.max(np.abs(
            flat(self.model.weights) - self.initial)))
        self.losses = [float(self.validation_loss())]
        self.save()

    def on_train_batch_end(self, batch, logs=None):
        self.micro_batches += 1
        if self.updates() >= len(self.losses):
            self.losses.append(float(self.validation_loss()))
            self.save()

    def save(self):
        if self.path:
            utils.write_json_atomically(
                self.path, {"start_gap": self.start_gap,
                            "losses": self.losses})


def train(way, args, vocab_size, initial, train_tokens, val_tokens):
    """Trains one way; with `--backup-dir`, keras_accum's way is backed up
    to a folder of its own there (the plain `keras.Model`s of the other
    ways start again from the beginning if killed)."""
    model = build_model(way, args, vocab_size)
    model.set_weights(initial)
    compile_model(model, way, args, run_eagerly=args.run_eagerly)
    backup = (os.path.join(args.backup_dir, way)
              if args.backup_dir and way == "keras_accum" else None)
    callbacks = utils.backup_callbacks(backup, args.save_freq)
    recorder = LossAfterEachUpdate(
        *inputs_and_targets(val_tokens),
        1 if way == "big_batch" else args.steps, initial,
        path=backup and os.path.join(backup, "val_loss_per_update.json"))
    # The recorder after `BackupAndRestore`, the test-only kill last.
    callbacks[2:2] = [recorder]
    start = time.perf_counter()
    history = model.fit(
        make_dataset(train_tokens, batch_size(way, args), args.seed),
        epochs=args.epochs, callbacks=callbacks, verbose=args.verbose,
        shuffle=False,  # The pipeline shuffles, with a fixed seed.
    ).history
    history = utils.whole_history(history, callbacks)


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


# ---------------------------------------------------------------------------
# Training in small memory (--memory-limit-mb)
# ---------------------------------------------------------------------------

BUCKETS = (16, 32, 64)  # Input lengths the batches are padded to.
MEMORY_VAL_BATCH = 32  # Evaluation does not split its batches.


def bucketed_dataset(tokens, batch_size, seed, shuffle=True):
    """Batches of sequences of about the same length, padded to the length
    of their bucket (16, 32 or 64 inputs): a shape `(None, None)` pipeline.

    `tokens`: `(num_sequences, max_length + 1)` ids, padded with PAD.
    """
    ds = tf.data.Dataset.from_tensor_slices(tokens)
    # Padding follows the real tokens (BOS and the words): cut it off.
    ds = ds.map(lambda t: t[: tf.math.count_nonzero(t != PAD, dtype="int32")])
    if shuffle:
        ds = ds.shuffle(len(tokens), seed=seed, reshuffle_each_iteration=True)
    # n words are n + 1 tokens, trained on as n inputs and n targets: a
    # bucket of up to b inputs holds up to b + 1 tokens (boundaries are
    # exclusive), and is padded to b + 1.
    ds = ds.bucket_by_sequence_length(
        element_length_func=lambda t: tf.shape(t)[0],
        bucket_boundaries=[b + 2 for b in BUCKETS],
        bucket_batch_sizes=[batch_size] * (len(BUCKETS) + 1),
        padding_values=PAD,
        pad_to_bucket_boundary=True,
    )
    return ds.map(inputs_and_targets, num_parallel_calls=AUTOTUNE).prefetch(
        AUTOTUNE)


def with_length(ds, batches):
    """`ds`, which Keras otherwise sees as of unknown length."""
    return ds.apply(tf.data.experimental.assert_cardinality(batches))


def train_in_small_memory(args, vocabulary, train_tokens, val_tokens):
    """One model, `micro_batch_size="auto"`, on the bucketed batches."""
    if args.max_length > BUCKETS[-1]:
        raise ValueError(f"`--max-length` must be at most {BUCKETS[-1]} "
                         "with `--memory-limit-mb` (the longest bucket). "
                         f"Received: max_length={args.max_length}")
    model = build_model("auto", args, len(vocabulary))
    compile_model(model, "auto", args)
    # A pipeline of its own shows the first epoch's batches (the same seed
    # gives the same first order); their number tells `fit()` the length
    # of the epoch (as many in every epoch: the buckets hold the same
    # sequences).
    shapes = [tuple(x.shape) for x, _ in bucketed_dataset(
        train_tokens, args.batch_size, args.seed)]
    print(f"Batches of the first epoch (rows, length): {shapes}")
    train_ds = with_length(
        bucketed_dataset(train_tokens, args.batch_size, args.seed),
        len(shapes))
    val_ds = bucketed_dataset(val_tokens, MEMORY_VAL_BATCH, args.seed,
                              shuffle=False)
    val_ds = with_length(val_ds, int(val_ds.reduce(0, lambda n, _: n + 1)))
    log = utils.AutoMicroBatchLog()
    start = time.perf_counter()
    with log:
        history = model.fit(
            train_ds, epochs=args.epochs, callbacks=[log],
            validation_data=val_ds,
            verbose=args.verbose or 2, shuffle=False,
        ).history
    seconds = time.perf_counter() - start
    peak = log.peak / 2**20 if log.peak else None
    print(log.describe_recoveries() + ":" * bool(log.recoveries)
          + "".join(f"\n  epoch {r['epoch'] + 1}, batch {r['batch'] + 1}: "
                    f"{r['message']}" for r in log.recoveries)
          + (f"\nPeak of the train steps: {peak:,.0f} MiB of the "
             f"{args.memory_limit_mb:,} MiB limit." if peak else ""))
    return {
        "limit_mib": args.memory_limit_mb,
        "batch_size": args.batch_size,
        "buckets": list(BUCKETS),
        "first_epoch_batches": [list(shape) for shape in shapes],
        "recoveries": log.recoveries,
        "choices": log.choices,
        "micro_batch_sizes": log.micro_batch_sizes,
        "peak_mib": peak,
        "updates": int(model.optimizer.iterations.numpy()),
        "loss_per_epoch": [float(v) for v in history["loss"]],
        "val_loss_per_epoch": [float(v) for v in history["val_loss"]],
        "train_seconds": seconds,
    }


def result_of_child(args, code):
    """What `main()` returns, read from the JSON of a run in a child."""
    if code:
        raise SystemExit(code)
    path = os.path.join(args.output_dir, "language_model_memory.json")
    with open(path) as f:
        return {**json.load(f), "json": path}


def main(argv=None):
    start = time.perf_counter()
    parser = utils.add_backup_flags(
        lm_utils.build_parser(utils.docstring_title(__doc__)))
    args = lm_utils.resolve(parser.parse_args(argv))
    utils.check_backup_flags(args)
    if args.memory_limit_mb:
        # On a CPU the limit must be set before TensorFlow starts: then the
        # run happens in a child process.
        code = utils.limit_device_memory(args.memory_limit_mb, __file__, argv)
        if code is not None:
            return result_of_child(args, code)
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
          f"{words.mean():.1f}), e.g. \"{' '.join(corpus[0][:12])} ...\"")

    if not args.memory_limit_mb:
        print("Real tokens in the first window's micro-batches: "
              f"{first.sum(axis=1).tolist()}")
    else:
        results = {**train_in_small_memory(args, vocabulary, train_tokens,
                                           val_tokens),
                   "args": vars(args),
                   "wall_time_s": time.perf_counter() - start}
        numbers = os.path.join(args.output_dir, "language_model_memory.json")
        with open(numbers, "w") as f:
            json.dump(results, f, indent=2)
        print(f"Wrote numbers: {numbers}\n"
              f"Wall time: {results['wall_time_s']:.1f} s")
        return {**results, "json": numbers}

    # Every way, in both checks, starts from these weights.
    initial = build_model("big_batch", args, len(vocabulary)).get_weights()
    differences = {
        optimizer: first_window_differences(
            args, len(vocabulary), initial, train_tokens, optimizer)
        for optimizer in ["sgd", "adam"]}
    table = lm_utils.markdown_table(differences, args)
    print("\nFirst window, relative difference of the total weight update to "
          f"the big batch's (float64):\n\n{table}\n")

    # With `--backup-dir`, the ways trained to their end before a restart
    # are kept there, and not trained again.
    runs, finished = {}, None
    if args.backup_dir:
        finished = os.path.join(args.backup_dir, "finished_runs.json")
        if os.path.exists(finished):
            with open(finished) as f:
                runs = json.load(f)
    for way in WAYS:
        label = lm_utils.labels(args, 'Adam')[way]
        if way in runs:
            print(f"Trained before the restart: {label}.")
            continue
        print(f"Training: {label} ...", flush=True)
        runs[way] = train(way, args, len(vocabulary), initial, train_tokens,
                          val_tokens)
        print(f"  {runs[way]['updates']} updates, final validation loss "
              f"{runs[way]['val_loss_per_update'][-1]:.4f}")
        if finished:
            os.makedirs(args.backup_dir, exist_ok=True)
            utils.write_json_atomically(finished, runs)
    runs = {way: runs[way] for way in WAYS}

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
    if args.backup_dir:  # Training has ended: as `BackupAndRestore` does.
        shutil.rmtree(args.backup_dir, ignore_errors=True)
    print(f"Wrote figure: {figure}\nWrote numbers: {numbers}\n"
          f"Wall time: {results['wall_time_s']:.1f} s")
    return {**results, "table": table, "figure": figure, "json": numbers}


if __name__ == "__main__":
    main()
