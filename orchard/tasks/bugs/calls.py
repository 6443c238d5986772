"""Call and text bugs: arguments swapped at a call site, and the wrong string method or case
handling."""

from __future__ import annotations

import random

from orchard.tasks.bugs.base import Case, Variant

WORDS = ["alpine", "Alpha", "almond", "Beta", "bishop", "Album", "delta", "Alder", "canyon", "alley"]
HEADERS = ["Content Type", "accept_encoding", "X Request Id", "user_agent", "Cache Control", "if_none_match"]
STEMS = ["report", "data", "notes", "summary", "export", "backup", "invoice"]


def _percent_cases(rng: random.Random) -> list[Case]:
    total = rng.randint(5, 12)
    return [Case("some_failed", (rng.randint(1, total - 1), total)), Case("all_passed", (total, total)),
            Case("empty_run", (0, 0)), Case("none_passed", (0, total))]


def _percent_caller_cases(rng: random.Random) -> list[Case]:
    mixed = [True] * rng.randint(2, 6) + [False] * rng.randint(1, 3)
    rng.shuffle(mixed)
    return [Case("mixed_results", (mixed,)), Case("all_green", ([True] * rng.randint(2, 5),)),
            Case("no_tests", ([],))]


PERCENT = Variant(
    family="swapped_args", name="pass_rate",
    helper='''def @AUX@(part, whole):
    if whole == 0:
        return 0.0
    return round(100.0 * part / whole, 1)


def @HELPER@(passed, total):
    """Pass rate of a run as a percentage with one decimal (0.0 for an empty run)."""
    return @AUX@(passed, total)
''',
    bug=("return @AUX@(passed, total)", "return @AUX@(total, passed)"),
    caller='''def @CALLER@(results):
    """Summary of a test run from one boolean per test, like '3/4 passed (75.0%)'."""
    passed = sum(1 for result in results if result)
    return f"{passed}/{len(results)} passed ({@HELPER@(passed, len(results))}%)"
''',
    helper_names=("pass_rate", "success_rate", "rate_percent"),
    caller_names=("run_summary", "describe_run", "result_line"),
    aux_names=("percent", "as_percent", "percentage"),
    helper_cases=_percent_cases, caller_cases=_percent_caller_cases,
    summary="computes the rate the wrong way round (total over passed), so it can exceed 100",
    hint="pass rates above 100% show up in the dashboard",
)


def _clamp_cases(rng: random.Random) -> list[Case]:
    top = rng.choice([10, 11, 50, 100])
    return [Case("within_range", (top // 2, top)), Case("above_range", (top + rng.randint(1, 9), top)),
            Case("negative_level", (-rng.randint(1, 9), top)), Case("at_maximum", (top, top))]


def _clamp_caller_cases(rng: random.Random) -> list[Case]:
    top = rng.choice([10, 11, 50, 100])
    return [Case("mixed_requests", ([top // 3, top + 4, -2], top)),
            Case("all_too_loud", ([top + 1, top + 7], top))]


CLAMP = Variant(
    family="swapped_args", name="clamp_level",
    helper='''def @AUX@(value, low, high):
    return max(low, min(value, high))


def @HELPER@(level, maximum):
    """The level limited to the range 0..maximum."""
    return @AUX@(level, 0, maximum)
''',
    bug=("return @AUX@(level, 0, maximum)", "return @AUX@(level, maximum, 0)"),
    caller='''def @CALLER@(requests, maximum):
    """Each requested level limited to 0..maximum, in order."""
    return [@HELPER@(level, maximum) for level in requests]
''',
    helper_names=("limit_level", "bounded_level", "cap_level"),
    caller_names=("apply_limits", "limit_all", "normalize_levels"),
    aux_names=("clamp", "bound", "clip"),
    helper_cases=_clamp_cases, caller_cases=_clamp_caller_cases,
    summary="returns the maximum for every level at or below it",
    hint="the volume is always at full blast",
)


def _duration_cases(rng: random.Random) -> list[Case]:
    return [Case("over_an_hour", (rng.choice([75, 90, 125, 150, 185]),)), Case("exactly_one_hour", (60,)),
            Case("zero_minutes", (0,)), Case("under_an_hour", (rng.choice([5, 15, 25, 45]),))]


def _duration_caller_cases(rng: random.Random) -> list[Case]:
    first, second, third = rng.sample(["review", "deploy", "triage", "standup", "planning"], 3)
    split = rng.choice([15, 25, 35])
    return [Case("a_long_day", ([(first, 95), (second, rng.choice([40, 50, 70])), (third, 30)],)),
            Case("one_hour_in_total", ([(first, split), (second, 60 - split)],))]


DURATION = Variant(
    family="swapped_args", name="duration",
    helper='''def @HELPER@(minutes):
    """A duration in whole minutes as H:MM."""
    hours, rest = divmod(minutes, 60)
    return f"{hours}:{rest:02d}"
''',
    bug=("divmod(minutes, 60)", "divmod(60, minutes)"),
    caller='''def @CALLER@(tasks):
    """The total time of (name, minutes) tasks, formatted H:MM."""
    return @HELPER@(sum(minutes for _, minutes in tasks))
''',
    helper_names=("format_minutes", "hhmm", "as_clock"),
    caller_names=("total_time", "timesheet_total", "time_spent"),
    helper_cases=_duration_cases, caller_cases=_duration_caller_cases,
    summary="gets hours and minutes wrong for anything but exactly one hour",
    hint="the totals in the timesheet make no sense",
)


def _header_cases(rng: random.Random) -> list[Case]:
    first, second, third = rng.sample(HEADERS, 3)
    return [Case("leading_space", ("  " + first,)), Case("mixed_case", (second.upper(),)),
            Case("trailing_space", (third + " \t",))]


def _header_caller_cases(rng: random.Random) -> list[Case]:
    first, second = rng.sample(HEADERS, 2)
    return [Case("padded_names", ({" " + first: "yes", second: "no"},)),
            Case("clean_names", ({first: "1", second.title(): "2"},))]


HEADER = Variant(
    family="string_case", name="header_key",
    helper='''def @HELPER@(name):
    """The canonical form of a header name: trimmed, lower-case, dashes for spaces and underscores."""
    key = name.strip().lower()
    return key.replace(" ", "-").replace("_", "-")
''',
    bug=("name.strip().lower()", "name.rstrip().lower()"),
    caller='''def @CALLER@(headers):
    """The headers with canonical names (a later duplicate wins)."""
    return {@HELPER@(name): value for name, value in headers.items()}
''',
    helper_names=("header_key", "canonical_header", "normalize_header"),
    caller_names=("canonical_headers", "clean_headers", "parse_headers"),
    helper_cases=_header_cases, caller_cases=_header_caller_cases,
    summary="keeps leading whitespace in the key",
    hint="some headers are not recognised after parsing",
)


def _prefix_cases(rng: random.Random) -> list[Case]:
    words = rng.sample(WORDS, 6)
    lower = [w.lower() for w in words]
    return [Case("capitalised_words", (words + ["Alto"], "al")), Case("lower_case_words", (lower, "AL")),
            Case("no_match", (lower, "zz"))]


def _prefix_caller_cases(rng: random.Random) -> list[Case]:
    words = rng.sample(WORDS, 7)
    return [Case("mixed_case_names", (words + ["Alto"], "al")),
            Case("lower_case_names", ([w.lower() for w in words], "b"))]


PREFIX = Variant(
    family="string_case", name="prefix_match",
    helper='''def @HELPER@(words, prefix):
    """The words that start with `prefix`, ignoring case, in their original order."""
    wanted = prefix.lower()
    return [word for word in words if word.lower().startswith(wanted)]
''',
    bug=("word.lower().startswith(wanted)", "word.startswith(wanted)"),
    caller='''def @CALLER@(names, query):
    """Autocomplete: at most three names that start with `query` (any case), sorted."""
    return sorted(@HELPER@(names, query))[:3]
''',
    helper_names=("starting_with", "prefixed", "match_prefix"),
    caller_names=("suggest", "autocomplete", "completions"),
    helper_cases=_prefix_cases, caller_cases=_prefix_caller_cases,
    summary="matches case-sensitively, so capitalised words are never found",
    hint="autocomplete misses obvious suggestions",
)


def _extension_cases(rng: random.Random) -> list[Case]:
    first, second, third = rng.sample(STEMS, 3)
    return [Case("upper_case_name", (f"{first.upper()}.CSV", [".csv"])),
            Case("lower_case_name", (f"{second}.csv", [".CSV", ".tsv"])),
            Case("other_extension", (f"{third}.txt", [".csv"]))]


def _extension_caller_cases(rng: random.Random) -> list[Case]:
    first, second, third = rng.sample(STEMS, 3)
    paths = [f"in/{first}.csv", f"in/{second.upper()}.CSV", f"out/{third}.json"]
    return [Case("mixed_case_files", (paths, [".csv"])),
            Case("lower_case_files", ([p.lower() for p in paths], [".csv", ".json"]))]


EXTENSION = Variant(
    family="string_case", name="has_extension",
    helper='''def @HELPER@(filename, extensions):
    """True when filename ends with one of the extensions (like '.csv'), whatever the case."""
    lowered = filename.lower()
    return any(lowered.endswith(extension.lower()) for extension in extensions)
''',
    bug=("lowered = filename.lower()", "lowered = filename"),
    caller='''def @CALLER@(paths, extensions):
    """The paths whose file name has one of the extensions, in order."""
    return [path for path in paths if @HELPER@(path.rsplit("/", 1)[-1], extensions)]
''',
    helper_names=("has_extension", "matches_extension", "is_kind"),
    caller_names=("select_files", "filter_paths", "pick_files"),
    helper_cases=_extension_cases, caller_cases=_extension_caller_cases,
    summary="does not recognise file names written in upper case",
    hint="some files are silently skipped",
)

VARIANTS = [PERCENT, CLAMP, DURATION, HEADER, PREFIX, EXTENSION]
