"""Source locations of a module's ops, carried onto the eqns the importer traces.

A StableHLO op says where it came from in its location: ``loc("model.py":42:7)``, JAX's
``loc("jit(f)/top_k"(callsite("moe"("model.py":42:7) at ...)))``, or, converted from an XLA dump's
``metadata={op_name=... source_file=... source_line=...}``, ``loc(fused["jit(f)/top_k",
"model.py":42:0])``. :func:`parse_location` reads the innermost frame (file, line, column,
function) and the op name out of that.

JAX records where each eqn was traced as a ``Traceback`` of Python frames
(``source_info_util.current()``), and ``eqn.where()`` -- what ``explain`` and the report print --
summarises its innermost user frame. So that the eqns name the user's file rather than the
importer's, each op is interpreted under ``source_info_util.user_context(traceback)`` with a
traceback captured in a frame of code compiled to sit at the op's file, line and column, named
after its function (:meth:`Locations.context`). JAX then treats it like any traced user code:
``eqn.where()`` reads ``model.py:42:7 (moe)``, and lowering the eqns again keeps the location.

What a Python frame cannot say -- an op name without a file, no line, no location at all, a file
JAX counts as its own -- is recorded as a frame in a placeholder file (``<...>``), and
:meth:`Locations.relabel` maps those summaries in a report to what they stand for: the op name,
``(no location in the module)``, the file.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import re
import types
from dataclasses import dataclass

NO_LOCATION = "(no location in the module)"

# Buffer names MLIR's parser gives ops that carry no ``loc(...)``: a place in the IR text, not in the program.
_PARSER_BUFFERS = ("", "-", "<unknown>")
_MAX_COLUMN = 4096  # a frame's column is the indentation of a compiled call; beyond this, column 0 (relabelled)


@dataclass(frozen=True)
class SourceLocation:
    """Where an op came from: the innermost source frame and/or the op's name (JAX name stack)."""

    file: str | None = None
    line: int = 0
    column: int = 0
    function: str | None = None
    op_name: str | None = None

    def describe(self) -> str:
        """``model.py:42:7 (moe)`` as JAX's ``eqn.where()`` writes it, else the op name, else
        :data:`NO_LOCATION`."""
        if self.file:
            where = self.file
            if self.line > 0:
                where += f":{self.line}" + (f":{self.column}" if self.column > 0 else "")
            label = self.function or self.op_name
            return f"{where} ({label})" if label else where
        return self.op_name or NO_LOCATION


# --------------------------------------------------------------------------------------------
# Reading MLIR locations (their printed form: the Python bindings have no accessors for them).


class _Syntax(Exception):
    pass


# One token per match: a string, a number, a keyword, or one punctuation character.
_TOKEN = re.compile(r'(")((?:[^"\\]|\\.)*)"|(\d+)|(callsite\(|loc\(|[()\[\]<>:,]|[^\s"()\[\]<>:,]+)', re.S)
_ESCAPE = re.compile(r"\\([0-9A-Fa-f]{2}|.)", re.S)


def _unescape(body: str) -> str:
    """MLIR's string escapes: ``\\"``, ``\\\\``, and two hex digits per byte of anything else
    (a non-ASCII path arrives as its UTF-8 bytes)."""
    out, position = bytearray(), 0
    for match in _ESCAPE.finditer(body):
        code = match.group(1)
        out += body[position : match.start()].encode() + (bytes([int(code, 16)]) if len(code) == 2 else code.encode())
        position = match.end()
    out += body[position:].encode()
    return out.decode("utf-8", "replace")


class _LocationParser:
    """``loc(...)`` as printed inline: unknown, file:line:col [to ...], "name"(child), callsite, fused.

    Tokens are ``("s", string)``, ``("n", number)`` or ``("w", keyword or punctuation)``.
    """

    def __init__(self, text: str):
        self.tokens = [
            ("s", _unescape(string) if "\\" in string else string) if quoted else ("n", int(number)) if number else ("w", word)
            for quoted, string, number, word in _TOKEN.findall(text)
        ]
        self.i = 0

    def take(self, word: str) -> bool:
        if self.i < len(self.tokens) and self.tokens[self.i] == ("w", word):
            self.i += 1
            return True
        return False

    def expect(self, word: str) -> None:
        if not self.take(word):
            raise _Syntax(f"expected {word!r} at token {self.i}")

    def next(self, kind: str):
        token = self.tokens[self.i]  # IndexError at the end: no location
        if token[0] != kind:
            raise _Syntax(f"unexpected {token[1]!r} at token {self.i}")
        self.i += 1
        return token[1]

    def node(self):
        kind, value = self.tokens[self.i]
        if kind == "s":
            self.i += 1
            if self.take(":"):
                line, column = self.next("n"), 0
                if self.take(":"):
                    column = self.next("n")
                if self.take("to"):  # a range: [line][:col]
                    if self.i < len(self.tokens) and self.tokens[self.i][0] == "n":
                        self.i += 1
                    if self.take(":"):
                        self.next("n")
                return ("file", value, line, column)
            if self.take("("):
                child = self.node()
                self.expect(")")
                return ("name", value, child)
            return ("name", value, None)
        self.i += 1
        if (kind, value) == ("w", "unknown"):
            return ("unknown",)
        if (kind, value) == ("w", "callsite("):
            callee = self.node()
            self.expect("at")
            caller = self.node()
            self.expect(")")
            return ("callsite", callee, caller)
        if (kind, value) == ("w", "fused"):
            if self.take("<"):  # fused<metadata>[...]: skip the metadata
                depth = 1
                while depth:
                    depth += {("w", "<"): 1, ("w", ">"): -1}.get(self.tokens[self.i], 0)
                    self.i += 1
            self.expect("[")
            items = [self.node()]
            while self.take(","):
                items.append(self.node())
            self.expect("]")
            return ("fused", items)
        raise _Syntax(f"unexpected {value!r} at token {self.i - 1}")


def parse_location(text: str) -> SourceLocation | None:
    """The :class:`SourceLocation` in a printed MLIR location, or None when it names nothing.

    The innermost frame is the callee end of a ``callsite`` chain; a name wrapping a file
    location is that frame's function when it sits in a call chain or under the op's name (JAX's
    full tracebacks), else the op's name (JAX without tracebacks, HLO metadata). Names ending in
    ``:`` (JAX's ``"top_k:"`` primitive marker) are skipped. Unreadable syntax is no location.
    """
    try:
        parser = _LocationParser(text)
        parser.expect("loc(")
        tree = parser.node()
        parser.expect(")")
        if parser.i != len(parser.tokens):
            raise _Syntax("trailing text")
    except (_Syntax, IndexError, ValueError):
        return None
    names: list[str] = []
    frames: list[tuple[str, int, int, str | None]] = []

    def visit(node, under_name: bool, in_call: bool) -> None:
        kind = node[0]
        if kind == "file":
            frames.append((node[1], node[2], node[3], None))
        elif kind == "callsite":
            visit(node[1], False, True)
            visit(node[2], False, True)
        elif kind == "fused":
            for item in node[1]:
                visit(item, under_name, in_call)
        elif kind == "name":
            name, child = node[1], node[2]
            if child is None:
                names.append(name)
            elif name.endswith(":"):
                visit(child, under_name, in_call)
            elif child[0] == "file" and (in_call or under_name) and "/" not in name:
                frames.append((child[1], child[2], child[3], name))
            else:
                names.append(name)
                visit(child, True, in_call)

    visit(tree, False, False)
    frames = [f for f in frames if f[0] not in _PARSER_BUFFERS]
    op_name = next((n for n in names if n), None)
    if frames:
        file, line, column, function = frames[0]
        return SourceLocation(file, line, column, function, op_name)
    return SourceLocation(op_name=op_name) if op_name else None


# --------------------------------------------------------------------------------------------
# Frames JAX can read: a traceback captured in code compiled to sit at the location.


_CALL_TEMPLATES: dict[int, types.CodeType] = {}


def _call_at_column(column: int) -> types.CodeType:
    """Module code calling ``c()`` on its first line, the call at ``column``."""
    code = _CALL_TEMPLATES.get(column)
    if code is None:
        source = "c()\n" if column == 0 else "(" + " " * (column - 1) + "c())\n"
        code = _CALL_TEMPLATES[column] = compile(source, "<moe-rewrite location>", "exec")
    return code


def _capture_traceback(file: str, line: int, column: int, function: str):
    """A ``Traceback`` whose innermost frame is ``function`` at ``file:line:column``.

    The frame is module code compiled with the call at that column and moved to that line; the
    callable it calls is C only (``list.extend`` consuming a ``starmap`` of
    ``Traceback.get_traceback``), so no Python frame of ours lies inside it.
    """
    from jax._src.lib import xla_client

    column = column if 0 <= column <= _MAX_COLUMN else 0
    code = _call_at_column(column).replace(
        co_filename=file, co_name=function, co_qualname=function, co_firstlineno=max(1, line))
    captured: list = []
    capture = functools.partial(captured.extend, itertools.starmap(xla_client.Traceback.get_traceback, [()]))
    exec(code, {"c": capture})  # noqa: S102 - our own two-token program
    return captured[0]


class Locations:
    """Per import: the traceback for each op location, and what its summary should read."""

    def __init__(self):
        self._by_text: dict[str, object] = {}  # printed location -> traceback or None
        self._by_location: dict[SourceLocation, object] = {}
        self.labels: dict[str, str] = {}  # eqn.where() of a placeholder frame -> what to print

    def context(self, op):
        """A context manager under which JAX records ``op``'s location on the eqns it traces;
        a null context when the op has none (it keeps the enclosing op's, or the module default)."""
        try:
            text = str(op.location)
        except Exception:  # noqa: BLE001 - a location is a nicety, never a failure
            return contextlib.nullcontext()
        if text not in self._by_text:
            location = parse_location(text)
            self._by_text[text] = self.traceback(location) if location is not None else None
        traceback = self._by_text[text]
        return contextlib.nullcontext() if traceback is None else _user_context(traceback)

    def default(self):
        """The context for ops without a location of their own: :data:`NO_LOCATION`."""
        traceback = self.traceback(SourceLocation())
        return contextlib.nullcontext() if traceback is None else _user_context(traceback)

    def traceback(self, location: SourceLocation):
        if location in self._by_location:
            return self._by_location[location]
        from jax._src import source_info_util

        display = location.describe()
        file = location.file
        if not file:
            file = "<no location in the module>" if display == NO_LOCATION else "<no source file>"
        elif location.line <= 0 or not source_info_util.is_user_filename(file):
            file = f"<{file}>"  # no line to place the frame on, or a file JAX's summaries skip
        function = location.function or location.op_name or "?"
        try:
            traceback = _capture_traceback(file, location.line, location.column, function)
            summary = source_info_util.summarize(source_info_util.SourceInfo(traceback, source_info_util.NameStack()))
        except Exception:  # noqa: BLE001 - jaxlib without tracebacks: the eqns keep the importer's
            traceback, summary = None, None
        if traceback is not None and summary != display:
            self.labels.setdefault(summary, display)
        self._by_location[location] = traceback
        return traceback

    def relabel(self, report):
        """``report`` (an ``ExplainReport``) with placeholder locations replaced by :meth:`labels`."""
        if not self.labels:
            return report

        def fix(item):
            changes = {}
            for field in dataclasses.fields(item):
                value = getattr(item, field.name)
                if isinstance(value, str):
                    fixed = value
                    for summary, display in self.labels.items():
                        fixed = fixed.replace(summary, display)
                    if fixed != value:
                        changes[field.name] = fixed
            return dataclasses.replace(item, **changes) if changes else item

        return dataclasses.replace(
            report,
            regions=tuple(fix(r) for r in report.regions),
            near_misses=tuple(fix(n) for n in report.near_misses),
        )


def _user_context(traceback):
    from jax._src import source_info_util

    return source_info_util.user_context(traceback)
