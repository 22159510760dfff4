"""What a method is: its declared options, its phases, its samples.

A method of the trainer is one object (a subclass of :class:`Method`) in its own module of
this package, listed once in :mod:`train_zoo.methods.registry`. It says

- its ``name`` and a one-line ``summary``;
- its ``options``: :class:`MethodOption` records (name, check, default, one line of
  help) made by :func:`declared_options` from the option declarations of
  :mod:`posteriorzoo.vocabulary` (constraints, literal defaults, help) and the module's
  own rules (derived defaults, checks that need the model or the other options);
  validated once when a spec is read (:mod:`train_zoo.method_options`); the vocabulary
  alone is listed by ``posteriorzoo train --list-options``;
- its phases, :meth:`Method.fit`: steppers that the one loop
  (:func:`train_zoo.loop.fit`) drives, returning the method's posterior state;
- :meth:`Method.sample` ``(state, generator, count)``: ``count`` state_dicts of the base
  architecture.

Engines stay out of methods: a method asks its :class:`ModeRun`'s ``engine``
(:class:`Engine`, built by :mod:`train_zoo.programs`) for a base network, an SGD stepper,
batches or a gradient, and the engine falls back to torch where it has no kernel.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from posteriorzoo.options import check_constraints
from posteriorzoo.vocabulary import DERIVED, OptionInfo, options_of
from train_zoo.recipes import Recipe

StateDict = dict[str, Any]


# ---------------------------------------------------------------- declared options
@dataclass(frozen=True)
class Context:
    """What a default or a check may depend on: the spec's architecture, model options,
    output count, recipe and samples per mode, and the options of the method resolved
    before this one (in table order)."""

    method: str
    architecture: str
    recipe: Recipe
    model_options: Mapping[str, Any] = field(default_factory=dict)
    num_classes: int | None = None
    resolved: dict[str, Any] = field(default_factory=dict)
    samples_per_mode: int | None = None

    def parameter_count(self) -> int:
        """Trainable parameters of the spec's model (built on the meta device)."""
        from posteriorzoo.models import parameter_count

        return parameter_count(self.architecture, self.num_classes, **self.model_options)


@dataclass(frozen=True)
class Resolved:
    """A value with where it came from: ``source`` is ``"given"``, ``"default"`` or
    ``"derived from ..."``; ``note`` is one line saying why the value differs from the
    option's usual default (None when it does not)."""

    value: Any
    source: str = "default"
    note: str | None = None


#: ``check(what, value, context)``: the value checked (or a :class:`Resolved`, when the
#: check completes it, as Laplace's ``structure = "auto"``); raises InvalidOptionError.
Check = Callable[[str, Any, Context], Any]
#: ``default(context)``: the value when the spec does not give one.
DefaultRule = Callable[[Context], Resolved]


@dataclass(frozen=True)
class MethodOption:
    """One option of a method: its name, its check, its default and one line of help.

    ``default_text`` is the default as the listing shows it (a rule, where the default
    depends on the recipe or the model).
    """

    name: str
    check: Check
    default: DefaultRule
    default_text: str
    help: str
    #: Whether a collection records the resolved value (None: always). An option added
    #: after collections were made is recorded only where it shapes the weights, so their
    #: specs still resolve to the recipe they record and can be resumed.
    recorded: Callable[[Context], bool] | None = None


def constant(value: Any) -> DefaultRule:
    """A default that depends on nothing."""
    return lambda context: Resolved(value)


def with_context(check: Callable[..., Any], *args: Any, **kwargs: Any) -> Check:
    """A check of :mod:`posteriorzoo.options` with fixed bounds, as a :data:`Check`."""
    return lambda what, value, context: check(what, value, *args, **kwargs)


def _declared_check(info: OptionInfo, extra: Check | None) -> Check:
    """The check of ``info``: its declared constraints, then ``extra`` (a check that needs
    the model or the options resolved before it)."""
    def check(what: str, value: Any, context: Context) -> Any:
        if value is None and info.default is None:  # unset: the trainer fills it in
            return value
        value = check_constraints(what, value, info.constraints, context.resolved)
        return value if extra is None else extra(what, value, context)
    return check


def declared_options(method: str, *, checks: Mapping[str, Check] | None = None,
                     defaults: Mapping[str, DefaultRule] | None = None,
                     recorded: Mapping[str, Callable[[Context], bool]] | None = None
                     ) -> tuple[MethodOption, ...]:
    """The :class:`MethodOption` records of ``method``, made from its declarations in
    :data:`posteriorzoo.vocabulary.METHODS` (names, constraints, literal defaults, help),
    so the bounds and defaults are written once.

    Parameters
    ----------
    checks : mapping, optional
        Per option, a check run after the declared constraints (one that needs the model
        or the other options: Laplace's dense-matrix limit, SWAG's collection window).
    defaults : mapping, optional
        Per option whose declared default is ``DERIVED``: its rule. Every derived default
        needs one, and a literal default takes none.
    recorded : mapping, optional
        Per option: whether a collection records its resolved value
        (:attr:`MethodOption.recorded`; absent: always).

    Raises
    ------
    RuntimeError
        When the module's rules and the declarations disagree (a derived default without
        a rule, a rule for a literal default or for an option not declared): the method's
        module fails at import, not when a spec is read.
    """
    checks, defaults, recorded = dict(checks or {}), dict(defaults or {}), dict(recorded or {})
    infos = options_of(method)
    names = {info.name for info in infos}
    for kind, rules in (("check", checks), ("default", defaults), ("recorded", recorded)):
        unknown = sorted(set(rules) - names)
        if unknown:
            raise RuntimeError(f"{method}: {kind} rules for undeclared options {unknown}")
    records = []
    for info in infos:
        if info.default is DERIVED:
            if info.name not in defaults:
                raise RuntimeError(f"{method} option {info.name!r}: a derived default needs "
                                   "its rule")
            default = defaults[info.name]
        elif info.name in defaults:
            raise RuntimeError(f"{method} option {info.name!r}: its default is declared "
                               f"({info.default!r}), not derived")
        else:
            default = constant(info.default)
        records.append(MethodOption(info.name, _declared_check(info, checks.get(info.name)),
                                    default, info.default_text, info.help,
                                    recorded.get(info.name)))
    return tuple(records)


def recipe_lr(context: Context) -> Resolved:
    """The default of an ``lr`` option that follows the recipe."""
    return Resolved(context.recipe.lr, "derived from the recipe (its lr)")


@dataclass(frozen=True)
class ResolvedOptions:
    """A method's options after :meth:`Method.explain`.

    Attributes
    ----------
    values : dict
        Every option, defaults filled in (what a collection records).
    sources : dict
        Per option: ``"given"``, ``"default"``, or ``"derived from ..."`` (and for BBB
        ``"from the preset ..."``).
    notes : tuple of str
        One line per default that differs from its usual value because of the recipe's
        length or the model's size, e.g. ``swag: iterates 2 (derived from epochs=4;
        default 20 at 60 epochs)``.
    """

    values: dict[str, Any]
    sources: dict[str, str]
    notes: tuple[str, ...]


# ---------------------------------------------------------------- one mode's run
class Engine(Protocol):
    """What a method may ask of the engine that runs its mode (:mod:`train_zoo.programs`).

    ``name`` is the engine that ran the base network (``fast`` or ``torch``); every method
    falls back to torch where the engine has no kernel for a piece.
    """

    name: str

    def train_base(self) -> tuple[Any, int]: ...

    def initial_model(self) -> Any: ...

    def sgd_stepper(self, model: Any) -> Any: ...

    def batches(self, model: Any, seed: int, batch_size: int | None = None, *,
                torch_only: bool = False, replacement: bool = False
                ) -> Callable[[int], Any]: ...

    def read_batches(self, seed: int, batch_size: int | None = None) -> Any: ...

    def load_stepper_weights(self, model: Any, stepper: Any) -> None: ...

    def loss_gradient(self, model: Any) -> Any | None: ...

    def rank1_network(self, model: Any, layers: dict) -> Any | None: ...

    def log_posterior(self, model: Any, params: Any, buffers: Any, num_data: int,
                      prior_precision: float) -> Any: ...

    def bbb_stepper(self, model: Any, start: Any, run: Any) -> Any: ...


@dataclass
class ModeRun:
    """Everything one mode's phases need: the spec, the mode's index and seeds
    (:func:`train_zoo.seeds.checkpoint_seeds`), the training data, the engine and the
    callbacks every phase reports to.

    ``progress`` is a folder of the mode's own where a long phase may keep its state
    between runs (HMC writes its chain there after every iteration), so a killed run
    resumes the mode where it stopped, not from its start. The collection run
    (:mod:`train_zoo.run`) gives each mode ``.<output name>.progress/mode-<i>/`` beside
    the output file and removes it once the mode is committed; None when there is no
    such place (the phase then keeps its state in memory only).
    """

    spec: Any
    index: int
    seeds: Any
    data: Any
    engine: Engine
    callbacks: Sequence[object] = ()
    progress: Path | None = None

    @property
    def num_data(self) -> int:
        return len(self.data.train)


@dataclass
class Posterior:
    """What :meth:`Method.fit` returns: the method's own ``state`` (given back to
    :meth:`Method.sample`), the gradient steps its phases took (the base network's
    included), the engine that ran them and the record the collection keeps for the mode
    (JSON-able, or None)."""

    state: Any
    steps: int
    engine: str
    record: dict[str, Any] | None = None


class Method:
    """One method of the trainer (module docstring). Subclasses set the class attributes
    and implement :meth:`fit` and :meth:`sample`."""

    #: The name specs and collections use.
    name: str = ""
    #: One line for ``posteriorzoo train --help`` and the data card.
    summary: str = ""
    #: The declared options, in the order they are resolved and listed.
    options: tuple[MethodOption, ...] = ()
    #: A mode is one trained network (``samples_per_mode`` must be 1), as DE's members.
    one_sample_per_mode: bool = False
    #: The vectorised engine (many small models in lockstep) can train it.
    vectorisable: bool = False
    #: The collection's recipe records an option resolved for the training-set size
    #: (:meth:`recorded_options`), so resuming needs the data.
    options_need_data: bool = False
    #: Each mode first trains a base network with the recipe (BBB trains its variational
    #: posterior instead, in its own first phase).
    trains_base: bool = True
    #: The method fits a curvature at the trained weights (what ``--dry-run`` times).
    fits_curvature: bool = False
    #: The fast engine has kernels for the method's phases; without them the engine
    #: ``auto`` picks torch (a method asked to run on ``fast`` falls back to torch).
    uses_fast_kernels: bool = True

    def phase_steps(self, spec: Any, steps_per_epoch: int) -> int:
        """Gradient steps of the method's own phase per mode, after the base network
        (0: none); ``steps_per_epoch`` at the recipe's batch size."""
        return 0

    def option_table(self) -> tuple[MethodOption, ...]:
        """The declared options: :attr:`options`, or those :meth:`build_options` makes on
        first use."""
        if not self.options:
            self.options = self.build_options()
        return self.options

    def build_options(self) -> tuple[MethodOption, ...]:
        """The options of a method that builds them on first use (none by default)."""
        return ()

    def explain(self, options: Mapping[str, Any], context: Context) -> ResolvedOptions:
        """Every option resolved in table order, with where it came from (given, default,
        derived) and the notes of derived defaults. ``options`` holds known names only."""
        sources: dict[str, str] = {}
        notes: list[str] = []
        for option in self.option_table():
            given = option.name in options
            result = (Resolved(options[option.name], "given") if given
                      else option.default(context))
            checked = option.check(f"{self.name} option {option.name!r}", result.value,
                                   context)
            if isinstance(checked, Resolved):  # the check completed it ("auto")
                source = f"given ({checked.source})" if given else checked.source
                result = Resolved(checked.value, source, checked.note)
            else:
                result = Resolved(checked, result.source, result.note)
            context.resolved[option.name] = result.value
            sources[option.name] = result.source
            if result.note:
                notes.append(result.note)
        values = {option.name: context.resolved[option.name] for option in self.option_table()
                  if option.recorded is None or option.recorded(context)}
        return ResolvedOptions(values, {name: sources[name] for name in values}, tuple(notes))

    def check_model(self, architecture: str, model_options: Mapping[str, Any],
                    model_option_names: Sequence[str]) -> None:
        """Refuse a model the method cannot train (InvalidOptionError); the default
        accepts every model."""

    def training_model_options(self, model_options: Mapping[str, Any],
                               method_options: Mapping[str, Any]) -> dict[str, Any]:
        """The options base networks are trained with (default: the stored
        architecture's)."""
        return dict(model_options)

    def recorded_options(self, options: Mapping[str, Any], num_data: int | None
                         ) -> dict[str, Any]:
        """The options a collection records (default: as resolved)."""
        return dict(options)

    def fit(self, run: ModeRun) -> Posterior:
        """Run the method's phases for one mode."""
        raise NotImplementedError

    def sample(self, state: Any, generator: Any, count: int) -> list[StateDict]:
        """``count`` state_dicts of the base architecture from the posterior ``state``."""
        raise NotImplementedError

    def sample_chains(self, state: Any, count: int) -> list[int] | None:
        """The Markov chain each of the first ``count`` samples of :meth:`sample` was
        drawn from (0 .. chains-1, stored as the metadata column ``chain``, which
        diagnostics group draws by), or None for a method without chains (the default)."""
        return None


def generator_for(seed: int) -> Any:
    """A ``torch.Generator`` seeded with ``seed``."""
    import torch

    generator = torch.Generator()
    generator.manual_seed(seed)
    return generator


class Collector:
    """Keeps copies of the weights at chosen epochs (SWAG) or steps (SGHMC): a callback of
    :func:`train_zoo.loop.fit`."""

    def __init__(self, names: Sequence[str], epochs: AbstractSet[int] = frozenset(),
                 steps: AbstractSet[int] = frozenset()) -> None:
        self.names, self.epochs, self.steps = list(names), epochs, steps
        self.kept: list[dict[str, Any]] = []

    def _keep(self, weights: Mapping[str, Any]) -> None:
        import torch

        self.kept.append({name: torch.tensor(weights[name]) for name in self.names})

    def on_epoch_end(self, info: Any, weights: Mapping[str, Any]) -> None:
        if info.epoch in self.epochs:
            self._keep(weights)

    def on_step_end(self, info: Any, weights: Mapping[str, Any]) -> None:
        if info.step in self.steps:
            self._keep(weights)
