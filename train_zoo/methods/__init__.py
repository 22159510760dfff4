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

Each method of the trainer is one object, a :class:`~train_zoo.methods.base.Method` in
its own module here (``de``, ``dropout``, ``swag``, ``laplace``, ``sghmc``, ``bbb``): its
name, its declared options, its phases (steppers for :func:`train_zoo.loop.fit`) and
``sample(state, generator, count)``. :mod:`train_zoo.methods.registry` lists them; the
trainer (:mod:`train_zoo.programs`, :mod:`train_zoo.run`) looks a spec's method up there,
runs its phases for every mode, draws ``samples_per_mode`` samples and stores them with
``mode_id`` (the base network) and ``sample_id`` (the draw). Engines stay out: a method
asks the engine its mode runs on (:class:`~train_zoo.programs.ModeEngine`) for base
networks, SGD steppers, batches and gradients.
"""
