"""Posterior approximations as small functional pieces: ``init``, ``update``, ``sample``.

Every method turns trained base networks into **posterior samples stored as ordinary
checkpoints of the base architecture**, so the canonicalizer, the MMD engine and the
metrics treat all methods alike. The pieces follow the `posteriors` library's style:
pure functions of tensors on ``torch.func``; no module state, no global random state.

The contract (each method module of this package):

- Parameters are a ``dict[str, torch.Tensor]`` keyed like ``model.named_parameters()``
  (float64 or float32 as given); buffers (BatchNorm statistics) are a separate dict.
  ``torch.func.functional_call(model, (params, buffers), (images,))`` evaluates the
  network at given parameters.
- A *batch* is ``(images, labels)``: float images ``(B, C, H, W)``, already normalised and
  augmented, and int64 labels ``(B,)``. Batches come from an iterable the caller builds
  (the trainer's seeded data order), so methods never read data sets themselves.
- Randomness comes only from a ``torch.Generator`` argument.
- ``init(...)`` returns the method's state (a frozen dataclass of tensors and floats);
  ``update(state, batch, ...)`` returns a new state (iterative methods: SWAG collection,
  SGHMC, BBB); ``sample(state, generator, count)`` returns ``count`` state_dicts
  (parameters and buffers) that load into the base architecture.
- Options are validated once (``InvalidOptionError`` with one line naming the option).

The trainer (:mod:`train_zoo.run`) drives these pieces for every mode of a spec: it
trains the base network with the recipe, runs the method's phases, draws
``samples_per_mode`` samples and stores them with ``mode_id`` (the base network) and
``sample_id`` (the draw).
"""
