"""keras-hub tasks: converted with `from_model()`, or subclassed.

Tiny models built from config, with a vocabulary made here (nothing is
downloaded). The reference is keras-hub's own task on the big batch.
"""

import functools
import types

import keras
import numpy as np
import pytest
from conftest import RTOL
from conftest import assert_close_to_reference
from helpers import Interrupt
from helpers import Plain
from helpers import import_keras_hub

import keras_accum

keras_hub = import_keras_hub()

GAM = keras_accum.GradientAccumulationModel
MERGES = [
    "Ġ a", "Ġ t", "Ġ i", "Ġ b", "a i", "p l", "n e", "Ġa t", "p o", "r t",
    "Ġt h", "ai r", "pl a", "po rt", "Ġai r", "Ġa i", "pla ne",
]
# Very different lengths: micro-batches of 2 hold 16, 5, 10 and 3 tokens.
TEXTS = [
    "airplane at airport airplane",
    "airplane at airport airport at",
    "air",
    "port",
    "airplane airport",
    "at airport air",
    "plane",
    "air",
]
SEQUENCE_LENGTH = 12


def _vocabulary():
    tokens = ["<|endoftext|>", "!"]
    for merge in MERGES:
        for token in merge.split(" ") + [merge.replace(" ", "")]:
            for t in [token, *token]:
                if t not in tokens:
                    tokens.append(t)
    return {t: i for i, t in enumerate(tokens)}


def _preprocessor():
    """The tiny tasks' `GPT2CausalLMPreprocessor` (its own tokenizer)."""
    tokenizer = keras_hub.models.GPT2Tokenizer(
        vocabulary=_vocabulary(), merges=MERGES
    )
    return keras_hub.models.GPT2CausalLMPreprocessor(
        tokenizer, sequence_length=SEQUENCE_LENGTH
    )


def _gpt2(cls=None, seed=0, with_preprocessor=True, **kwargs):
    """A tiny `GPT2CausalLM` (or `cls`), with its preprocessor unless
    `with_preprocessor` is `False` (it then trains on `_tokens()`)."""
    keras.utils.set_random_seed(seed)
    preprocessor = _preprocessor()
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=preprocessor.tokenizer.vocabulary_size(),
        num_layers=1,
        num_heads=2,
        hidden_dim=8,
        intermediate_dim=16,
        max_sequence_length=SEQUENCE_LENGTH,
        dropout=0.0,
    )
    cls = cls or keras_hub.models.GPT2CausalLM
    if not with_preprocessor:
        preprocessor = None
    return cls(backbone=backbone, preprocessor=preprocessor, **kwargs)


@functools.cache
def _tokens():
    """`TEXTS` through the preprocessor, once: `(x, y, sample_weight)`, the
    padding mask the sample weight. (Each `fit()` on raw strings traces the
    tokenizer again, which costs more than training the tiny model.)"""
    return keras.tree.map_structure(np.asarray, _preprocessor()(TEXTS))


def _assert_window_equals_big_batch(case, initial, reference, ours):
    """Relative update difference, per tensor, where the update is not 0.

    The attention's key bias has a zero gradient (softmax does not see a
    shift): its "update" is rounding noise (1e-22), compared in absolute
    terms against the largest update instead.
    """
    reference = [np.asarray(w, np.float64) for w in reference.get_weights()]
    ours = [np.asarray(w, np.float64) for w in ours.get_weights()]
    largest = max(np.max(np.abs(r - w0)) for r, w0 in zip(reference, initial))
    moving = [
        i for i, (r, w0) in enumerate(zip(reference, initial))
        if np.max(np.abs(r - w0)) > 1e-12 * largest
    ]
    for i in set(range(len(initial))) - set(moving):
        assert np.max(np.abs(ours[i] - initial[i])) <= 1e-12 * largest
    pick = lambda ws: [ws[i] for i in moving]  # noqa: E731
    return assert_close_to_reference(
        case, pick(initial), pick(reference), pick(ours), RTOL["float64"]
    )


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """A task converted with `from_model()`, trained on raw strings, saved.

    Two epochs of 4 micro-batches with N=3: a window, then a pending one of
    a single micro-batch, applied when the epoch ends. Shared by the tests
    that read it (training a task is what takes time).
    """
    task = _gpt2()
    optimizer = task.optimizer  # keras-hub compiles in `__init__`
    model = GAM.from_model(task, gradient_accumulation_steps=3)
    # Raw strings in, through the task's preprocessor.
    history = model.fit(TEXTS, batch_size=2, epochs=2, verbose=0)
    path = str(tmp_path_factory.mktemp("gpt2") / "gpt2.keras")
    model.save(path)
    return types.SimpleNamespace(
        task=task, optimizer=optimizer, model=model, history=history,
        iterations=int(model.optimizer.iterations), path=path,
    )


def test_converted_task_stays_a_task(converted):
    model = converted.model
    assert model is converted.task
    assert isinstance(model, keras_hub.models.GPT2CausalLM)
    assert isinstance(model, GAM)
    assert model.preprocessor is not None
    assert model.optimizer is converted.optimizer
    assert converted.iterations == 4
    assert converted.history.history["updates"] == [2, 4]
    assert isinstance(model.generate("air", max_length=6), str)
    # `compile()` without arguments keeps keras-hub's defaults.
    model.compile()
    default = _gpt2(seed=1)
    assert type(model.optimizer) is type(default.optimizer)
    assert float(model.optimizer.learning_rate) == float(
        default.optimizer.learning_rate
    )
    assert type(model.loss) is type(default.loss)


def test_converted_task_saved_and_loaded(converted):
    # Saved after `fit()` (whose epochs ended with a pending window).
    model = converted.model
    loaded = keras.saving.load_model(converted.path)
    assert isinstance(loaded, keras_hub.models.GPT2CausalLM)
    assert isinstance(loaded, GAM)
    assert loaded.gradient_accumulation_steps == 3
    assert loaded.preprocessor is not None
    for a, b in zip(model.get_weights(), loaded.get_weights()):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(
        loaded.predict(["air at"], verbose=0),
        model.predict(["air at"], verbose=0),
    )
    # The pending windows were applied when the epochs ended: 4 updates,
    # and the optimizer goes on.
    assert int(loaded.optimizer.iterations) == 4
    loaded.fit(TEXTS[:6], batch_size=2, verbose=0)
    assert int(loaded.optimizer.iterations) == 5


def test_padded_language_model_window_equals_big_batch(float64):
    # The preprocessor's padding mask is the sample weight. The mean over
    # real tokens (`mean_with_sample_weight`) divides by their number, which
    # differs per micro-batch: only an exact normaliser gives the big batch.
    # (keras-hub's default loss divides by all positions: see the subclass
    # test below.)
    def compile_kwargs(steps=None):
        return dict(
            optimizer=keras.optimizers.SGD(
                0.5, gradient_accumulation_steps=steps
            ),
            loss=keras.losses.SparseCategoricalCrossentropy(
                from_logits=True, reduction="mean_with_sample_weight"
            ),
        )

    x, y, sample_weight = _tokens()
    reference = _gpt2(with_preprocessor=False)
    ours = GAM.from_model(
        _gpt2(with_preprocessor=False), gradient_accumulation_steps=4
    )
    builtin = _gpt2(with_preprocessor=False)
    initial = [np.array(w) for w in reference.get_weights()]
    for model in (ours, builtin):
        np.testing.assert_array_equal(model.get_weights()[0], initial[0])
    for model, batch, steps in ((reference, 8, None), (ours, 2, None),
                                (builtin, 2, 4)):
        model.compile(**compile_kwargs(steps))
        model.fit(x, y, sample_weight=sample_weight, batch_size=batch,
                  shuffle=False, verbose=0)
    assert int(ours.optimizer.iterations) == 1
    _assert_window_equals_big_batch(
        "keras-hub GPT2CausalLM, mean over real tokens (from_model)",
        initial, reference, ours,
    )
    # The case is sensitive: averaging micro-batch means is far off.
    with pytest.raises(AssertionError):
        _assert_window_equals_big_batch(
            "keras-hub GPT2CausalLM, mean over real tokens, built-in option",
            initial, reference, builtin,
        )


class AccumulatingGPT2(GAM, keras_hub.models.GPT2CausalLM):
    """Multiple inheritance with a keras-hub task."""


def test_subclass_of_a_task_keeps_every_class_intact(float64):
    # keras-hub's `PipelineModel.__init__` resets its own bases on every
    # instance (its workaround for Keras' rewrite); every other class must
    # keep its bases.
    bases = {
        cls: cls.__bases__
        for cls in (GAM, AccumulatingGPT2, *keras_hub.models.GPT2CausalLM.__mro__)
        if cls.__name__ != "PipelineModel"
    }
    # keras-hub compiles in `__init__` (`compile=True`), before ours ran.
    first = _gpt2(AccumulatingGPT2, gradient_accumulation_steps=4)
    second = _gpt2(AccumulatingGPT2, gradient_accumulation_steps=4)
    for model in (first, second):
        assert isinstance(model, keras_hub.models.GPT2CausalLM)
        assert model.optimizer is not None
    changed = [cls for cls in bases if cls.__bases__ != bases[cls]]
    assert not changed, [(c, bases[c], c.__bases__) for c in changed]

    reference = _gpt2()
    initial = [np.array(w) for w in reference.get_weights()]
    reference.compile(optimizer=keras.optimizers.SGD(0.5))
    reference.fit(TEXTS, batch_size=8, verbose=0)
    second.compile(optimizer=keras.optimizers.SGD(0.5))
    second.fit(TEXTS, batch_size=2, verbose=0)
    _assert_window_equals_big_batch(
        "keras-hub GPT2CausalLM, default loss (subclass)",
        initial, reference, second,
    )

    # Plain subclasses of ours still work afterwards.
    plain = Plain(gradient_accumulation_steps=2)
    plain.compile(optimizer="sgd", loss="mse")
    plain.fit(np.ones((4, 3)), np.ones((4, 1)), batch_size=2, verbose=0)
    assert int(plain.optimizer.iterations) == 1


def test_image_segmenter():
    keras.utils.set_random_seed(0)
    encoder = keras_hub.models.ResNetBackbone(
        input_conv_filters=[64],
        input_conv_kernel_sizes=[3],
        stackwise_num_filters=[64, 64],
        stackwise_num_blocks=[1, 1],
        stackwise_num_strides=[1, 2],
        block_type="basic_block",
        use_pre_activation=False,
        image_shape=(32, 32, 3),
    )
    backbone = keras_hub.models.DeepLabV3Backbone(
        image_encoder=encoder,
        spatial_pyramid_pooling_key="P3",
        upsampling_size=8,
        dilation_rates=[1, 2],
        image_shape=(32, 32, 3),
    )
    segmenter = keras_hub.models.DeepLabV3ImageSegmenter(
        backbone=backbone, num_classes=3
    )
    model = GAM.from_model(segmenter, gradient_accumulation_steps=4)
    assert isinstance(model, keras_hub.models.DeepLabV3ImageSegmenter)
    model.compile(
        optimizer="adam",
        loss=keras.losses.SparseCategoricalCrossentropy(
            from_logits=True, ignore_class=255
        ),
    )
    rng = np.random.default_rng(0)
    x = rng.normal(size=(16, 32, 32, 3)).astype("float32")
    y = rng.integers(0, 3, size=(16, 32, 32, 1))
    y[:, :4] = 255  # an ignored band
    moving = [w for w in model.weights if "moving_mean" in w.path][0]
    before = np.array(moving)
    model.fit(x, y, batch_size=2, epochs=1, verbose=0)
    assert int(model.optimizer.iterations) == 2
    # BatchNormalization statistics move once per window (2 updates).
    assert not np.allclose(before, np.array(moving))
    assert model.predict(x[:2], verbose=0).shape == (2, 32, 32, 3)


def _retinanet(seed=0):
    """A tiny `RetinaNetObjectDetector`: a 3-stack ResNet on 32x32 images,
    pyramid levels P3 and P4 with one anchor per position."""
    keras.utils.set_random_seed(seed)
    encoder = keras_hub.models.ResNetBackbone(
        input_conv_filters=[64],
        input_conv_kernel_sizes=[3],
        stackwise_num_filters=[64, 8, 8],
        stackwise_num_blocks=[1, 1, 1],
        stackwise_num_strides=[1, 2, 2],
        block_type="basic_block",
        use_pre_activation=False,
        image_shape=(32, 32, 3),
    )
    backbone = keras_hub.models.RetinaNetBackbone(
        image_encoder=encoder,
        min_level=3,
        max_level=4,
        use_p5=False,
        image_shape=(32, 32, 3),
    )
    anchor_generator = keras_hub.layers.AnchorGenerator(
        "yxyx",
        min_level=3,
        max_level=4,
        num_scales=1,
        aspect_ratios=[1.0],
        anchor_size=1,
    )
    return keras_hub.models.RetinaNetObjectDetector(
        backbone=backbone,
        anchor_generator=anchor_generator,
        num_classes=2,
        pre_logits_num_conv_layers=1,
    )


def _detection_data(n=4):
    """Images with two boxes each, near an anchor of P3 and one of P4
    (positives: IoU > 0.5), shifted so that the box loss is not 0."""
    rng = np.random.default_rng(0)
    images = rng.uniform(0, 255, size=(n, 32, 32, 3)).astype("float32")
    anchors = np.array([[4, 4, 12, 12], [8, 8, 24, 24]], "float32")
    boxes = anchors + rng.uniform(-0.5, 0.5, size=(n, 2, 4)).astype("float32")
    labels = np.tile(np.array([0, 1], "int32"), (n, 1))
    return images, {"boxes": boxes, "labels": labels}


def test_retinanet_reloads_in_plain_keras(tmp_path):
    # The baseline: Keras reloads keras-hub's detector (without calling its
    # custom `compile()`), so the converted one must reload too.
    task = _retinanet()
    path = str(tmp_path / "retinanet.keras")
    task.save(path)
    with pytest.warns(UserWarning, match="was not called as part of model"):
        loaded = keras.saving.load_model(path)
    assert type(loaded) is keras_hub.models.RetinaNetObjectDetector
    for a, b in zip(task.get_weights(), loaded.get_weights()):
        np.testing.assert_array_equal(a, b)


@pytest.fixture(scope="module")
def converted_retinanet(tmp_path_factory):
    """A detector converted with `from_model(task, 2)`, compiled with
    keras-hub's defaults, trained for one window of 2 micro-batches, saved."""
    task = _retinanet()
    model = GAM.from_model(task, gradient_accumulation_steps=2)
    model.compile()  # `ObjectDetector.compile()`: builds `loss=` itself
    x, y = _detection_data()
    initial = [np.array(w) for w in model.get_weights()]
    # Its classification and box losses have normalisers of their own: the
    # update is approximate, and training says so.
    with pytest.warns(UserWarning, match="several terms whose normalisers"):
        history = model.fit(x, y, batch_size=2, epochs=1, verbose=0)
    path = str(tmp_path_factory.mktemp("retinanet") / "retinanet.keras")
    model.save(path)
    return types.SimpleNamespace(
        task=task, model=model, x=x, y=y, initial=initial, history=history,
        path=path,
    )


def _assert_is_converted_retinanet(model):
    assert isinstance(model, keras_hub.models.RetinaNetObjectDetector)
    assert isinstance(model, GAM)
    assert model.gradient_accumulation_steps == 2


def test_converted_retinanet_saved_and_loaded(converted_retinanet):
    model = converted_retinanet.model
    assert model is converted_retinanet.task
    _assert_is_converted_retinanet(model)
    assert converted_retinanet.history.history["loss"][0] > 0
    assert int(model.optimizer.iterations) == 1
    assert any(
        not np.array_equal(a, b)
        for a, b in zip(converted_retinanet.initial, model.get_weights())
    )
    # `ObjectDetector.compile()` does not take the saved `loss=`: not
    # compiled on load, with Keras' own warning for such classes (it used
    # to raise "got multiple values for keyword argument 'loss'").
    with pytest.warns(UserWarning, match="was not called as part of model"):
        loaded = keras.saving.load_model(converted_retinanet.path)
    _assert_is_converted_retinanet(loaded)
    for a, b in zip(model.get_weights(), loaded.get_weights()):
        np.testing.assert_array_equal(a, b)
    x, y = converted_retinanet.x, converted_retinanet.y
    expected = model.predict(x[:2], verbose=0)
    predicted = loaded.predict(x[:2], verbose=0)
    assert set(predicted) == set(expected)
    for key in expected:
        np.testing.assert_array_equal(predicted[key], expected[key])
    # Compiled again by hand, it trains: 2 micro-batches, one update.
    loaded.compile()
    before = int(loaded.optimizer.iterations)
    loaded.fit(x, y, batch_size=2, epochs=1, verbose=0)
    assert int(loaded.optimizer.iterations) == before + 1


def test_converted_retinanet_serialized_and_deserialized(converted_retinanet):
    model = converted_retinanet.model
    config = keras.saving.serialize_keras_object(model)
    assert config["compile_config"] is not None
    with pytest.warns(UserWarning, match="was not called as part of model"):
        restored = keras.saving.deserialize_keras_object(config)
    _assert_is_converted_retinanet(restored)
    assert [w.shape for w in restored.weights] == [
        w.shape for w in model.weights
    ]
    # Compiled by hand, with keras-hub's defaults. (Its `train_on_batch()`
    # does not take the dict of boxes and labels: `fit()` above does.)
    restored.compile()
    assert set(restored.loss) == {"bbox_regression", "cls_logits"}



def test_converted_task_resumes_with_its_default_metrics(tmp_path, float64):
    # keras-hub compiles a weighted accuracy by default: the restart's
    # skipped batches build it and continue the epoch's value.
    x, y, sample_weight = _tokens()

    def run(callbacks):
        task = GAM.from_model(
            _gpt2(with_preprocessor=False), gradient_accumulation_steps=2
        )
        task.fit(x, y, sample_weight=sample_weight, batch_size=2, epochs=2,
                 shuffle=False, verbose=0, callbacks=callbacks)
        return task

    reference = run([])
    backup = tmp_path / "backup"
    with pytest.raises(RuntimeError, match="interrupted"):
        run([keras_accum.callbacks.BackupAndRestore(backup, save_freq=1),
             Interrupt(1, 3)])
    resumed = run([keras_accum.callbacks.BackupAndRestore(backup, save_freq=1)])
    assert resumed.history.epoch == [1]
    assert int(resumed.optimizer.iterations) == 4
    _assert_window_equals_big_batch(
        "keras-hub GPT2CausalLM resumed mid-epoch", [
            np.asarray(w, np.float64) for w in _gpt2().get_weights()
        ], reference, resumed,
    )
    last = {k: v[-1] for k, v in reference.history.history.items()}
    assert "sparse_categorical_accuracy" in last
    assert {k: v[-1] for k, v in resumed.history.history.items()} == last
