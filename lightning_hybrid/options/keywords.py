"""The strategy's option arguments generated from its options dataclass,
:class:`~lightning_hybrid.options.hybrid_options.HybridOptions`: the one place an option is declared (its field: name, type,
default; its entry in the class docstring's ``Arguments:``). :func:`keyword_options` gives the strategy class

* a signature (``__init__.__signature__``) with every option as a keyword-only parameter of the field's type and
  default, before the ``__init__``'s own explicit parameters: what ``inspect.signature``, ``help()``, IDEs and
  jsonargparse (``LightningCLI``'s ``--trainer.strategy.*`` arguments, ``--print_config``) read;
* a docstring whose ``Arguments:`` section starts with the dataclass's entries, one per option: what ``help()`` shows
  and what jsonargparse's docstring parser turns into one description per ``--help`` argument.

The ``__init__`` takes the options as ``**option_values`` and builds the dataclass with :func:`options_from`, which
names an unknown argument and the valid ones. Adding an option is adding its field (with its docstring entry) and
its validation; the strategy, the recipes' command lines and their ``--help`` follow. Static type checkers see
``**option_values: Any``; a fully typed call builds the dataclass itself (``HybridStrategy.from_options``).

Usage::

    @keyword_options(HybridOptions)
    class HybridStrategy(ModelParallelStrategy):
        '''...

        Arguments:
            monitor: ...
        '''

        def __init__(self, *, monitor=True, **option_values):
            self.options = options_from(HybridOptions, option_values, type(self))
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import re
import typing
from typing import Any, Callable, Mapping, Optional, TypeVar

__all__ = ["keyword_options", "option_parameters", "options_from"]

Cls = TypeVar("Cls", bound=type)
# A Google-style section header, "Arguments:" or "Args:" alone on its line.
_SECTION = re.compile(r"^\s*(?:Arguments|Args):\s*$")


def keyword_options(options_class: type) -> Callable[[Cls], Cls]:
    """Class decorator: the class's ``__init__`` signature and docstring get one keyword-only parameter and one
    ``Arguments:`` entry per init field of the dataclass ``options_class`` (see the module docstring). The
    ``__init__`` must take them as ``**kwargs``; its other parameters, keyword-only, stay as written, after the
    options."""

    def decorate(cls: Cls) -> Cls:
        init = cls.__dict__.get("__init__")  # not an inherited one: its signature would change for the base too
        if init is None:
            raise TypeError(f"@keyword_options needs {cls.__name__} to define its own __init__(self, *, ..., **options)")
        own = [parameter for parameter in inspect.signature(init).parameters.values()
               if parameter.kind is not inspect.Parameter.VAR_KEYWORD]
        hints = typing.get_type_hints(init)
        own = [parameter.replace(annotation=hints.get(parameter.name, parameter.annotation)) for parameter in own]
        parameters = [*own[:1], *option_parameters(options_class), *own[1:]]  # self, the options, the explicit ones
        init.__signature__ = inspect.Signature(parameters, return_annotation=None)  # an __init__ returns None
        cls.__doc__ = with_option_entries(cls.__doc__ or "", options_class.__doc__ or "")
        return cls

    return decorate


def option_parameters(options_class: type) -> list[inspect.Parameter]:
    """The init fields of the dataclass ``options_class`` as keyword-only parameters, their types resolved (so that
    readers of the signature need not evaluate the dataclass module's postponed annotations)."""
    hints = typing.get_type_hints(options_class)
    parameters = []
    for field in dataclasses.fields(options_class):
        if not field.init:
            continue  # derived on construction, not an argument
        default = field.default
        if default is dataclasses.MISSING:
            default = inspect.Parameter.empty if field.default_factory is dataclasses.MISSING else field.default_factory()
        parameters.append(inspect.Parameter(field.name, inspect.Parameter.KEYWORD_ONLY, default=default,
                                            annotation=hints[field.name]))
    return parameters


def options_from(options_class: type, values: Mapping[str, Any], caller: type) -> Any:
    """The options dataclass built from the keyword ``values`` of a call of ``caller``. An unknown name raises a
    ``TypeError`` naming it, the close valid names and every valid one (the dataclass would name itself instead)."""
    names = {field.name for field in dataclasses.fields(options_class) if field.init}
    unknown = [name for name in values if name not in names]
    if unknown:
        valid = list(inspect.signature(caller).parameters)
        close = {name: difflib.get_close_matches(name, valid, n=1) for name in unknown}
        hints = "".join(f" ({name!r}: did you mean {match[0]!r}?)" for name, match in close.items() if match)
        raise TypeError(f"{caller.__name__}() got unexpected keyword argument(s) {', '.join(map(repr, unknown))}"
                        f"{hints}. Its arguments: {', '.join(valid)}.")
    return options_class(**values)


def with_option_entries(doc: str, options_doc: str) -> str:
    """``doc`` with the ``Arguments:`` entries of ``options_doc`` inserted first in its own ``Arguments:`` section,
    indented as that section is."""
    lines, options_lines = doc.splitlines(), options_doc.splitlines()
    header, options_header = _section_header(lines), _section_header(options_lines)
    if header is None or options_header is None:
        raise ValueError("both docstrings need an 'Arguments:' section to merge the options' entries into")
    shift = _indent(lines[header]) - _indent(options_lines[options_header])
    entries = [_shifted(line, shift) for line in _section(options_lines, options_header)]
    return "\n".join([*lines[:header + 1], *entries, *lines[header + 1:]])


def _section_header(lines: list[str]) -> Optional[int]:
    return next((index for index, line in enumerate(lines) if _SECTION.match(line)), None)


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def _shifted(line: str, shift: int) -> str:
    if not line.strip():
        return ""
    return " " * shift + line if shift >= 0 else line[-shift:]


def _section(lines: list[str], header: int) -> list[str]:
    """The lines of the section under ``lines[header]``: those after it that are blank or indented deeper."""
    section = []
    for line in lines[header + 1:]:
        if line.strip() and _indent(line) <= _indent(lines[header]):
            break
        section.append(line)
    while section and not section[-1].strip():
        section.pop()
    return section
