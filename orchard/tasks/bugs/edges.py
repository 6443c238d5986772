"""Edge-case bugs: a wrong default or a missed edge case (empty input, even counts, messy text),
and a wrong accumulator initialisation."""

from __future__ import annotations

import random

from orchard.tasks.bugs.base import Case, Variant, ints

NAMES = ["ada lovelace", "alan turing", "grace hopper", "edsger dijkstra", "barbara liskov", "donald knuth",
         "frances allen", "john backus", "radia perlman", "ken thompson"]


def _mean_cases(rng: random.Random) -> list[Case]:
    return [Case("no_values", ([],)), Case("no_values_custom_default", ([], -1.0)),
            Case("several_values", (ints(rng, rng.randint(3, 6), 1, 50),)),
            Case("single_value", ([rng.randint(1, 99)],))]


def _mean_caller_cases(rng: random.Random) -> list[Case]:
    first, second, third = rng.sample(["north", "south", "east", "west", "central"], 3)
    return [Case("with_an_empty_group", ({first: ints(rng, 3, 1, 40), second: []},)),
            Case("all_groups_filled", ({first: ints(rng, 2, 1, 40), third: ints(rng, 4, 1, 40)},))]


MEAN = Variant(
    family="empty_input", name="mean_default",
    helper='''def @HELPER@(values, default=0.0):
    """The arithmetic mean of values rounded to 2 places, or `default` when there are none."""
    if len(values) == 0:
        return default
    return round(sum(values) / len(values), 2)
''',
    bug=("if len(values) == 0:", "if values is None:"),
    caller='''def @CALLER@(groups):
    """The mean of each named group of numbers (0.0 for an empty group)."""
    return {name: @HELPER@(values) for name, values in groups.items()}
''',
    helper_names=("mean", "average", "mean_or_default"),
    caller_names=("group_means", "averages_by_group", "summarize_groups"),
    helper_cases=_mean_cases, caller_cases=_mean_caller_cases,
    summary="crashes with ZeroDivisionError on an empty sequence instead of returning the default",
    hint="it crashes for some inputs that look perfectly valid",
)


def _initials_cases(rng: random.Random) -> list[Case]:
    first, second = rng.sample(NAMES, 2)
    return [Case("full_name", (first,)), Case("blank_text", ("",)),
            Case("double_space", (second.replace(" ", "  "),)), Case("single_word", (first.split()[0],))]


def _initials_caller_cases(rng: random.Random) -> list[Case]:
    people = rng.sample(NAMES, 3)
    return [Case("with_a_blank_name", (people[:2] + [""],)),
            Case("padded_name", ([" " + people[0], people[2]],)),
            Case("tidy_names", (people,))]


INITIALS = Variant(
    family="empty_input", name="initials",
    helper='''def @HELPER@(text):
    """Upper-case initials of the words in text ('' when there are no words)."""
    return "".join(word[0].upper() for word in text.split())
''',
    bug=("text.split()", 'text.split(" ")'),
    caller='''def @CALLER@(people):
    """The initials of each person's name, in order; a blank name gives ''."""
    return [@HELPER@(name) for name in people]
''',
    helper_names=("initials", "monogram", "abbreviate"),
    caller_names=("all_initials", "badges", "monograms"),
    helper_cases=_initials_cases, caller_cases=_initials_caller_cases,
    summary="raises IndexError on an empty string, or when words are separated by more than one space",
    hint="it crashes on some of our (admittedly messy) data",
)


def _median_cases(rng: random.Random) -> list[Case]:
    even = rng.sample(range(1, 60), 4)
    return [Case("odd_count", (ints(rng, 5, 1, 60),)), Case("even_count", (even,)), Case("no_values", ([],))]


def _median_caller_cases(rng: random.Random) -> list[Case]:
    return [Case("even_number_of_requests", (rng.sample(range(5, 500, 5), 6),)),
            Case("odd_number_of_requests", (rng.sample(range(5, 500, 5), 3),)),
            Case("no_requests", ([],))]


MEDIAN = Variant(
    family="empty_input", name="median_even",
    helper='''def @HELPER@(values):
    """The median of values (None when there are none)."""
    if not values:
        return None
    ordered = sorted(values)
    middle = len(ordered) // 2
    if len(ordered) % 2:
        return ordered[middle]
    return (ordered[middle - 1] + ordered[middle]) / 2
''',
    bug=("return (ordered[middle - 1] + ordered[middle]) / 2", "return ordered[middle]"),
    caller='''def @CALLER@(durations):
    """A short report of request durations: {'count': n, 'median': m} (median None when empty)."""
    return {"count": len(durations), "median": @HELPER@(durations)}
''',
    helper_names=("median", "middle_value", "median_of"),
    caller_names=("latency_report", "duration_summary", "timing_stats"),
    helper_cases=_median_cases, caller_cases=_median_caller_cases,
    summary="returns the upper middle value for an even number of values instead of the mean of the two",
    hint="the median looks off for some batches",
)


def _product_cases(rng: random.Random) -> list[Case]:
    factors = ints(rng, 3, 2, 9)
    return [Case("several_factors", (factors,)), Case("no_factors", ([],)),
            Case("with_a_zero", (factors[:2] + [0],))]


def _product_caller_cases(rng: random.Random) -> list[Case]:
    rates = [rng.choice([1, 2, 3, 4, 5, 10]) for _ in range(3)]
    principal = rng.choice([100, 250, 1000, 5000])
    return [Case("three_years", (principal, rates)), Case("no_years", (principal, [])),
            Case("nothing_invested", (0, rates))]


PRODUCT = Variant(
    family="accumulator_init", name="product",
    helper='''def @HELPER@(factors):
    """The product of the factors (1 when there are none)."""
    result = 1
    for factor in factors:
        result *= factor
    return result
''',
    bug=("result = 1", "result = 0"),
    caller='''def @CALLER@(principal, rates):
    """The balance after growing `principal` by each yearly rate (in percent), to the cent."""
    return round(principal * @HELPER@([1 + rate / 100 for rate in rates]), 2)
''',
    helper_names=("product", "multiply_all", "prod"),
    caller_names=("compound", "grow_balance", "future_value"),
    helper_cases=_product_cases, caller_cases=_product_caller_cases,
    summary="returns 0 whatever the factors are",
    hint="every balance comes out as zero",
)


def _running_cases(rng: random.Random) -> list[Case]:
    negative = [-rng.randint(5, 9), -rng.randint(1, 4), -rng.randint(5, 9)]
    return [Case("negative_values", (negative + [rng.randint(1, 5)],)),
            Case("positive_values", (ints(rng, 4, 1, 30),)), Case("no_values", ([],))]


def _running_caller_cases(rng: random.Random) -> list[Case]:
    winter = [-rng.randint(8, 12), -rng.randint(4, 7), -rng.randint(9, 15), -rng.randint(1, 3)]
    return [Case("winter_week", (winter,)), Case("summer_week", (ints(rng, 5, 15, 35),))]


RUNNING = Variant(
    family="accumulator_init", name="running_max",
    helper='''def @HELPER@(values):
    """Running maximum: item i is the largest of values[0..i]."""
    result = []
    best = None
    for value in values:
        best = value if best is None else max(best, value)
        result.append(best)
    return result
''',
    bug=("best = None", "best = 0"),
    caller='''def @CALLER@(temperatures):
    """Indexes of the days that set a new record high (the first day always does)."""
    peaks = @HELPER@(temperatures)
    return [day for day, value in enumerate(temperatures) if day == 0 or value > peaks[day - 1]]
''',
    helper_names=("running_max", "cumulative_max", "high_water_marks"),
    caller_names=("record_days", "new_highs", "record_breakers"),
    helper_cases=_running_cases, caller_cases=_running_caller_cases,
    summary="starts from 0 instead of the first value, so negative values never show",
    hint="records are missed in winter",
)


def _join_cases(rng: random.Random) -> list[Case]:
    return [Case("comma_separated", (ints(rng, 3, 1, 99), ", ")), Case("single_part", (["x"], "-")),
            Case("empty_separator", (["a", "b", "c"], ""))]


def _join_caller_cases(rng: random.Random) -> list[Case]:
    rows = [ints(rng, 3, 1, 99), ["id", rng.randint(1, 9), "ok"]]
    return [Case("two_rows", (rows, ",")), Case("no_rows", ([], ";"))]


JOIN = Variant(
    family="accumulator_init", name="join_values",
    helper='''def @HELPER@(parts, separator):
    """The parts as text with `separator` between them (like str.join, for any values)."""
    text = ""
    for index, part in enumerate(parts):
        if index:
            text += separator
        text += str(part)
    return text
''',
    bug=('text = ""', "text = separator"),
    caller='''def @CALLER@(rows, separator=","):
    """One line of text per row, fields joined by `separator`."""
    return "\\n".join(@HELPER@(row, separator) for row in rows)
''',
    helper_names=("join_values", "glue", "joined"),
    caller_names=("to_lines", "export_rows", "render_rows"),
    helper_cases=_join_cases, caller_cases=_join_caller_cases,
    summary="puts an extra separator in front of the result",
    hint="the exported lines look malformed",
)

VARIANTS = [MEAN, INITIALS, MEDIAN, PRODUCT, RUNNING, JOIN]
