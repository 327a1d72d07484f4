"""The one registry class: names, entry points, options read from signatures.

A toy task-like registry (tasks with ``dtype, device, seed`` and options passed
on through ``**kw``, as the harness's) exercises every policy; the last tests
check that it reads the same options as the harness's own task registry.
"""

from __future__ import annotations

import importlib.metadata
import sys

import pytest

from stiefel._core.registry import REQUIRED, Registry, RegistryError, signature_options

GROUP = "stiefel_test.toy_tasks"


class Task:
    def __init__(self, dtype, device, seed):
        self.dtype, self.device, self.seed = dtype, device, seed


class Sequence(Task):
    def __init__(self, dtype, device, seed, n: int = 64, operator: bool | str = "auto", bias=False):
        super().__init__(dtype, device, seed)
        self.n, self.operator, self.bias = n, operator, bias


class Copying(Sequence):
    def __init__(self, dtype, device, seed, T: int = 100, lr: float = 0.1, **kw):
        super().__init__(dtype, device, seed, **kw)
        self.T, self.lr = T, lr


class Pca(Task):
    def __init__(
        self,
        dtype,
        device,
        seed,
        m: int | None = None,
        shape: tuple = (4, 2),
        name: str = "pca",
        extra=None,
    ):
        super().__init__(dtype, device, seed)


def _check_task(name, cls):
    if not (isinstance(cls, type) and issubclass(cls, Task)):
        raise TypeError(f"task {name!r}: {cls!r} is not a Task subclass")


def _name_task(name, cls):
    cls.name = name


def toy(**kw) -> Registry:
    reg = Registry(
        "task",
        argument="name",
        group=GROUP,
        reserved={"all": "it selects every task"},
        fixed=("dtype", "device", "seed"),
        check=_check_task,
        on_register=_name_task,
        typed=True,
        **kw,
    )
    return reg


@pytest.fixture
def eps(monkeypatch, tmp_path):
    """A fake entry-point group: ``eps.add(name, source)`` writes a plugin module."""

    class Group:
        entries: list = []
        calls: list = []
        modules: list = []

        def add(self, name, source=None, value=None):
            if source is not None:
                module = f"stiefel_toy_plugin_{name}_{len(self.modules)}"
                (tmp_path / f"{module}.py").write_text(source)
                monkeypatch.delitem(sys.modules, module, raising=False)
                self.modules.append(module)
                value = f"{module}:Plugin"
            self.entries.append(importlib.metadata.EntryPoint(name, value, GROUP))
            return value.split(":")[0]

    group = Group()
    group.entries, group.calls, group.modules = [], [], []

    def fake(**kw):
        group.calls.append(kw)
        return importlib.metadata.EntryPoints([e for e in group.entries if e.group == kw["group"]])

    base = type(sys)("stiefel_toy_base")  # what plugin modules import their base class from
    base.Task = Task
    monkeypatch.setitem(sys.modules, "stiefel_toy_base", base)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(importlib.metadata, "entry_points", fake)
    return group


PLUGIN = (
    "from stiefel_toy_base import Task\n\n"
    "class Plugin(Task):\n"
    "    def __init__(self, dtype, device, seed, k: int = 3):\n"
    "        super().__init__(dtype, device, seed)\n"
)


# ---------------------------------------------------------------- names
def test_register_get_available_in_registration_or_name_order():
    reg = toy()
    assert reg.register("copying")(Copying) is Copying and Copying.name == "copying"
    reg.register("pca")(Pca)
    reg.register("adding")(Sequence)
    assert reg.available() == ["copying", "pca", "adding"]
    assert reg.get("pca") is Pca and "pca" in reg and "nope" not in reg
    assert list(reg.items()) == ["copying", "pca", "adding"]
    assert reg.register("pca")(Pca) is Pca  # the same object again: nothing changes
    assert reg.available() == ["copying", "pca", "adding"]
    ordered = toy(sort=True)
    ordered.register("pca")(Pca)
    ordered.register("adding")(Sequence)
    assert ordered.available() == ["adding", "pca"] and list(ordered.items()) == ["adding", "pca"]


@pytest.mark.parametrize(
    ("name", "match"),
    [
        ("", "name=''.*non-empty str"),
        ("has space", "name='has space'.*Python identifier"),
        (3, "name=3.*non-empty str"),
        ("all", "name='all' is reserved.*selects every task"),
    ],
)
def test_bad_names_are_refused(name, match):
    reg = toy()
    with pytest.raises(ValueError, match=match) as err:
        reg.register(name)
    assert reg.available() == []
    assert isinstance(err.value, TypeError) == (not isinstance(name, str))  # a wrong type


def test_a_taken_name_names_what_is_taken_and_keeps_the_first():
    reg = toy()
    reg.register("copying")(Copying)
    reg.register("pca")(Pca)

    class Other(Task):
        pass

    with pytest.raises(ValueError, match=r"name='copying'.*Copying.*taken: copying, pca"):
        reg.register("copying")(Other)
    assert reg.get("copying") is Copying and not hasattr(Other, "name")


def test_wrong_kind_is_a_type_error_and_registers_nothing():
    reg = toy()
    with pytest.raises(TypeError, match="not a Task subclass"):
        reg.register("bad")(dict)
    assert reg.available() == [] and not hasattr(dict, "name")


def test_unknown_or_non_str_name_lists_the_available():
    reg = toy()
    reg.register("copying")(Copying)
    with pytest.raises(ValueError, match="name='copyng' is not supported; allowed: copying"):
        reg.get("copyng")
    with pytest.raises(ValueError, match=r"tasks\), all \(it selects every task\)"):
        reg.get("copyng")  # a reserved name is listed with what it means
    with pytest.raises(ValueError, match="name='all' is not a task: it selects every task"):
        reg.get("all")
    for error in (ValueError, TypeError):  # both conventions hold (RegistryError is both)
        with pytest.raises(error, match="name=None.*must be a str; allowed: copying"):
            reg.get(None)


def test_meta_is_kept_per_name_and_copied():
    reg = toy()
    reg.register("copying", default_lr=0.1)(Copying)
    reg.register("pca")(Pca)
    meta = reg.meta("copying")
    meta["default_lr"] = 5
    assert reg.meta("copying") == {"default_lr": 0.1} and reg.meta("pca") == {}
    with pytest.raises(ValueError, match="name='nope'"):
        reg.meta("nope")


def test_snapshot_and_restore():
    reg = toy()
    reg.register("copying", a=1)(Copying)
    saved = reg.snapshot()
    reg.register("pca")(Pca)
    with pytest.raises(ValueError):
        reg.register("copying")(Pca)
    reg.restore(saved)
    assert reg.available() == ["copying"] and reg.meta("copying") == {"a": 1}
    reg.register("pca")(Pca)  # the name is free again
    assert reg.available() == ["copying", "pca"]


# ---------------------------------------------------------------- entry points
def test_entry_points_are_scanned_once_on_first_use_and_loaded_on_demand(eps):
    module = eps.add("plugin", PLUGIN)
    reg = toy()
    assert eps.calls == []  # constructing (importing) scans nothing
    reg.register("copying")(Copying)
    assert reg.available() == ["copying", "plugin"] and eps.calls == [{"group": GROUP}]
    assert module not in sys.modules  # listed, not imported
    reg.available()
    assert len(eps.calls) == 1  # once
    cls = reg.get("plugin")
    assert module in sys.modules and cls.__name__ == "Plugin" and cls.name == "plugin"
    assert reg.options("plugin") == {"k": 3}
    assert reg.load_entry_points() == [] and len(eps.calls) == 1
    with pytest.warns(RuntimeWarning, match="'plugin'.*clashes"):  # now a registered name
        assert reg.load_entry_points(force=True) == [] and len(eps.calls) == 2


def test_a_registered_name_wins_over_an_entry_point(eps):
    module = eps.add("copying", PLUGIN)
    reg = toy()
    reg.register("copying")(Copying)
    with pytest.warns(RuntimeWarning, match=f"'copying' = '{module}:Plugin'.*clashes"):
        assert reg.available() == ["copying"]
    assert reg.get("copying") is Copying and module not in sys.modules


def test_registering_a_pending_entry_point_name_drops_it_with_a_warning(eps):
    module = eps.add("plugin", PLUGIN)
    reg = toy()
    assert "plugin" in reg.available()
    with pytest.warns(RuntimeWarning, match="'plugin'.*clashes.*registered one is used"):
        reg.register("plugin")(Pca)
    assert reg.get("plugin") is Pca and module not in sys.modules


def test_reserved_duplicate_and_bad_entry_point_names_warn(eps):
    eps.add("all", value="os:getcwd")
    eps.add("twice", value="os:getcwd")
    eps.add("twice", value="os:getcwd")
    eps.add("not-an-id", value="os:getcwd")
    reg = toy()
    with pytest.warns(RuntimeWarning) as record:
        assert reg.available() == ["twice"]
    text = " ".join(str(r.message) for r in record)
    assert "'all'" in text and "'twice'" in text and "'not-an-id'" in text and len(record) == 3
    # a reserved name is said to be reserved (it was said to clash with a registered one)
    (reserved,) = [str(r.message) for r in record if "'all'" in str(r.message)]
    assert "a reserved name (it selects every task)" in reserved and "clashes" not in reserved


def test_a_broken_entry_point_warns_naming_it_and_never_crashes(eps):
    eps.add("missing", value="no_such_module_xyz:Plugin")
    eps.add("wrong_kind", value="os:getcwd")
    good = eps.add("good", PLUGIN)
    reg = toy()
    assert reg.available() == ["missing", "wrong_kind", "good"]
    with pytest.warns(RuntimeWarning) as record:
        assert list(reg.items()) == ["good"]
    text = " ".join(str(r.message) for r in record)
    assert "'missing' = 'no_such_module_xyz:Plugin'" in text and "ModuleNotFoundError" in text
    assert "'wrong_kind' = 'os:getcwd'" in text and "not a Task subclass" in text
    assert good in sys.modules and reg.available() == ["good"]
    with pytest.raises(ValueError, match="name='missing'.*could not be loaded.*no_such_module"):
        reg.get("missing")


def test_a_plugin_that_registers_itself_is_accepted(eps):
    reg = toy()
    sys.modules["stiefel_toy_base"].reg = reg
    registers = "\nimport stiefel_toy_base\nstiefel_toy_base.reg.register('selfish')(Plugin)\n"
    module = eps.add("selfish", PLUGIN + registers)
    cls = reg.get("selfish")  # the module registered it on import; the entry point agrees
    assert cls.__module__ == module and cls.name == "selfish" and reg.available() == ["selfish"]


def test_an_unreadable_environment_warns_and_finds_nothing(monkeypatch):
    def broken(**kw):
        raise OSError("metadata is corrupt")

    monkeypatch.setattr(importlib.metadata, "entry_points", broken)
    reg = toy()
    reg.register("pca")(Pca)
    with pytest.warns(RuntimeWarning, match="could not read entry points.*corrupt"):
        assert reg.available() == ["pca"]


def test_no_group_never_reads_entry_points(eps):
    eps.add("plugin", PLUGIN)
    reg = Registry("thing")
    assert reg.available() == [] and eps.calls == []


# ---------------------------------------------------------------- options
def test_options_follow_kwargs_through_the_bases():
    reg = toy()
    reg.register("copying")(Copying)
    reg.register("pca")(Pca)
    assert reg.options("copying") == {
        "T": 100,
        "lr": 0.1,
        "n": 64,
        "operator": "auto",
        "bias": False,
    }
    assert reg.options("pca") == {"m": None, "shape": (4, 2), "name": "pca", "extra": None}


def test_options_of_factories_required_and_open_sets():
    class Base:
        def __init__(self, params, defaults):
            self.defaults = defaults

    class Packs(Base):
        def __init__(self, params, lr, **kw):
            super().__init__(params, dict(lr=lr, **kw))

    def factory(params, lr, *extra, momentum: float = 0.0):
        return params

    def wrapper(params, **kw):
        return Packs(params, **kw)

    wrapped = lambda params, **kw: Packs(params, **kw)  # noqa: E731
    wrapped.__wrapped__ = factory
    assert signature_options(factory, ("params",))[1] is False
    reg = Registry("optimizer", fixed=("params",), stop=(Base,))
    for name, obj in [("f", factory), ("packs", Packs), ("w", wrapper), ("wr", wrapped)]:
        reg.register(name)(obj)
    assert reg.options("f") == {"lr": REQUIRED, "momentum": 0.0} and repr(REQUIRED) == "<required>"
    assert reg.options("packs") == {"lr": REQUIRED}  # not Base's "defaults"
    assert reg.options("wr") == {"lr": REQUIRED, "momentum": 0.0}  # through __wrapped__
    with pytest.raises(
        RegistryError, match=r"'mom'.*optimizer name='f'; allowed: lr, momentum=0.0"
    ):
        reg.check_options("f", {"lr": 1, "mom": 0.9})
    with pytest.raises(RegistryError, match="'mom'.*optimizer name='wr'"):
        reg.check_options("wr", {"mom": 0.9})
    reg.check_options("packs", {"lr": 1, "anything": 2})  # **kw reaches Base: open
    reg.check_options("w", {"anything": 2})  # a function's **kw: open
    assert reg.options("w") == {}


def test_unknown_options_are_refused_listing_the_accepted():
    reg = toy()
    reg.register("copying")(Copying)
    reg.check_options("copying", {"T": 5, "n": 8, "operator": False})
    for error in (ValueError, TypeError):
        with pytest.raises(
            error,
            match=r"'q' for task name='copying'; allowed: T=100, lr=0.1, n=64, operator='auto'",
        ):
            reg.check_options("copying", {"T": 5, "q": 1})
    reg.check_options("copying", {"init": "haar"}, extra=("init",))
    with pytest.raises(RegistryError, match="allowed: init, generator, T=100"):
        reg.check_options("copying", {"bogus": 1}, extra=("init", "generator"))


@pytest.mark.parametrize(
    ("given", "ok"),
    [
        ({"T": 5}, True),
        ({"T": True}, False),  # a bool is not an int here
        ({"T": 5.0}, False),
        ({"T": "5"}, False),
        ({"lr": 1}, True),  # an int is a float
        ({"lr": "0.1"}, False),
        ({"operator": True}, True),  # bool | str
        ({"operator": "never"}, True),
        ({"operator": 1}, False),
        ({"bias": 1}, False),  # unannotated: the default False says bool
        ({"n": None}, False),
    ],
)
def test_typed_registry_checks_value_types(given, ok):
    reg = toy()
    reg.register("copying")(Copying)
    if ok:
        reg.check_options("copying", given)
    else:
        with pytest.raises(RegistryError, match=f"option {next(iter(given))}="):
            reg.check_options("copying", given)
    untyped = Registry("task", fixed=("dtype", "device", "seed"))
    untyped.register("copying")(Copying)
    untyped.check_options("copying", given)  # only names are checked


# ---------------------------------------------------------------- it can replace the task registry
def test_it_reads_the_harness_tasks_options_as_their_registry_does():
    from stiefel.comparisons import tasks

    reg = Registry("task", fixed=("dtype", "device", "seed"), typed=True)
    for name in tasks.available():
        cls = tasks.get(name)
        reg.register(name)(cls)
        mine = {k: None if v is REQUIRED else v for k, v in reg.options(name).items()}
        assert mine == tasks.options(name), name
    assert reg.available() == tasks.available()
    for name in tasks.available():
        for key, default in tasks.options(name).items():
            if isinstance(default, (bool, int, float, str)):
                reg.check_options(name, {key: default})
                tasks.check_options(name, {key: default})
