"""Boundary bugs: off-by-one in a range or slice, and a wrong comparison operator."""

from __future__ import annotations

import random

from orchard.tasks.bugs.base import Case, Variant, ints

WORDS = ["alpha", "bravo", "cedar", "delta", "ember", "fjord", "gale", "heron", "iris", "jade", "kite", "lumen"]


def _window_cases(rng: random.Random) -> list[Case]:
    size = rng.randint(2, 3)
    return [Case("several_windows", (ints(rng, rng.randint(5, 7)), size)),
            Case("series_as_long_as_window", (ints(rng, 3), 3)),
            Case("series_shorter_than_window", (ints(rng, 2), 4)),
            Case("rejects_zero_size", (ints(rng, 3), 0))]


def _window_caller_cases(rng: random.Random) -> list[Case]:
    low = ints(rng, rng.randint(3, 5), 1, 4)
    return [Case("peak_at_the_end", (low + ints(rng, 2, 8, 9), 2)),
            Case("peak_at_the_start", (ints(rng, 2, 8, 9) + low, 2)),
            Case("exactly_one_window", (ints(rng, 3), 3)),
            Case("too_few_readings", (ints(rng, 2), 3))]


WINDOW = Variant(
    family="off_by_one", name="window_sums",
    helper='''def @HELPER@(values, size):
    """Sums of every run of `size` consecutive values, in order."""
    if size <= 0:
        raise ValueError("size must be positive")
    totals = []
    for start in range(len(values) - size + 1):
        totals.append(sum(values[start:start + size]))
    return totals
''',
    bug=("range(len(values) - size + 1)", "range(len(values) - size)"),
    caller='''def @CALLER@(readings, size):
    """The largest total of `size` consecutive readings, or None when there are too few."""
    totals = @HELPER@(readings, size)
    return max(totals) if totals else None
''',
    helper_names=("window_sums", "rolling_totals", "moving_sums"),
    caller_names=("peak_window", "best_stretch", "max_run_total"),
    helper_cases=_window_cases, caller_cases=_window_caller_cases,
    summary="leaves out the last window (a series exactly one window long gives no sums at all)",
    hint="the most recent readings never seem to count",
)


def _tail_cases(rng: random.Random) -> list[Case]:
    items = rng.sample(WORDS, 6)
    return [Case("last_three", (items, 3)), Case("last_one", (items, 1)),
            Case("more_than_available", (items[:3], 5)), Case("zero_items", (items, 0))]


def _tail_caller_cases(rng: random.Random) -> list[Case]:
    start = rng.randint(100, 900)
    events = [(name, start + 7 * i) for i, name in enumerate(rng.sample(WORDS, 5))]
    return [Case("two_most_recent", (events, 2)), Case("asks_for_more_than_exist", (events[:2], 4)),
            Case("asks_for_none", (events, 0))]


TAIL = Variant(
    family="off_by_one", name="tail",
    helper='''def @HELPER@(items, count):
    """The last `count` items, oldest first (all of them when there are fewer; none for count <= 0)."""
    if count <= 0:
        return []
    return list(items[-count:])
''',
    bug=("items[-count:]", "items[-count + 1:]"),
    caller='''def @CALLER@(events, count):
    """Names of the `count` most recent events; events are (name, timestamp) pairs, oldest first."""
    return [name for name, _ in @HELPER@(events, count)]
''',
    helper_names=("last_items", "tail", "newest"),
    caller_names=("recent_names", "latest_events", "recent_activity"),
    helper_cases=_tail_cases, caller_cases=_tail_caller_cases,
    summary="returns the wrong number of items (one too few, and everything when asked for one)",
    hint="the list of recent entries has the wrong length",
)


def _page_cases(rng: random.Random) -> list[Case]:
    items = ints(rng, rng.randint(7, 11), 10, 99)
    return [Case("first_page", (items, 1, 3)), Case("second_page", (items, 2, 3)),
            Case("past_the_end", (items, 9, 3)), Case("rejects_page_zero", (items, 0, 3))]


def _page_caller_cases(rng: random.Random) -> list[Case]:
    items = ints(rng, rng.randint(5, 8), 10, 99)
    return [Case("several_pages", (items, 3)), Case("no_items", ([], 3)),
            Case("rejects_zero_page_size", (items, 0))]


PAGE = Variant(
    family="off_by_one", name="pagination",
    helper='''def @HELPER@(items, page, per_page):
    """The items on 1-based page `page` when showing `per_page` items per page."""
    if page < 1 or per_page < 1:
        raise ValueError("page and per_page must be at least 1")
    start = (page - 1) * per_page
    return items[start:start + per_page]
''',
    bug=("start = (page - 1) * per_page", "start = page * per_page"),
    caller='''def @CALLER@(items, per_page):
    """All pages of `items`, in order (no pages when there are no items)."""
    pages = []
    for page in range(1, len(items) + 2):
        chunk = @HELPER@(items, page, per_page)
        if not chunk:
            break
        pages.append(chunk)
    return pages
''',
    helper_names=("page_of", "get_page", "paginate"),
    caller_names=("all_pages", "split_pages", "page_list"),
    helper_cases=_page_cases, caller_cases=_page_caller_cases,
    summary="returns the items of the next page (page 1 shows what belongs on page 2)",
    hint="the first few items never show up",
)


def _between_cases(rng: random.Random) -> list[Case]:
    low = rng.randint(10, 20)
    high = low + rng.randint(5, 10)
    inside = [rng.randint(low + 1, high - 1) for _ in range(3)]
    return [Case("counts_upper_bound", (inside + [high, high + 4, low - 3], low, high)),
            Case("counts_lower_bound", (inside + [low, high + 2], low, high)),
            Case("inside_only", (inside, low, high)), Case("no_values", ([], low, high))]


def _between_caller_cases(rng: random.Random) -> list[Case]:
    top = rng.choice([10, 20, 100])
    passing = top // 2
    mid = [rng.randint(passing, top - 1) for _ in range(3)]
    return [Case("perfect_scores_count", (mid + [top, passing - 1], passing, top)),
            Case("middling_scores", (mid + [passing - 1], passing, top)),
            Case("no_scores", ([], passing, top))]


BETWEEN = Variant(
    family="comparison", name="count_between",
    helper='''def @HELPER@(values, low, high):
    """How many values lie between low and high, both included."""
    return sum(1 for value in values if low <= value <= high)
''',
    bug=("low <= value <= high", "low <= value < high"),
    caller='''def @CALLER@(scores, passing, top):
    """Share of scores from `passing` to `top` inclusive, rounded to 3 places (0.0 without scores)."""
    if not scores:
        return 0.0
    return round(@HELPER@(scores, passing, top) / len(scores), 3)
''',
    helper_names=("count_between", "count_in_range", "in_range_count"),
    caller_names=("pass_share", "passing_ratio", "share_passing"),
    helper_cases=_between_cases, caller_cases=_between_caller_cases,
    summary="does not count values equal to the upper bound",
    hint="the share is too low for some classes",
)


def _above_cases(rng: random.Random) -> list[Case]:
    limit = rng.randint(50, 70)
    below = [rng.randint(limit - 20, limit - 1) for _ in range(2)]
    return [Case("ignores_readings_at_limit", (below + [limit, limit + 3], limit)),
            Case("above_only", (below + [limit + 1], limit)),
            Case("nothing_above", (below, limit))]


def _above_caller_cases(rng: random.Random) -> list[Case]:
    limit = rng.randint(50, 70)
    below = [rng.randint(limit - 20, limit - 1) for _ in range(3)]
    return [Case("reading_at_limit_is_fine", (below + [limit], limit)),
            Case("reading_over_limit", (below + [limit + 2], limit)),
            Case("all_below", (below, limit))]


ABOVE = Variant(
    family="comparison", name="strictly_above",
    helper='''def @HELPER@(readings, limit):
    """The readings strictly above `limit`, in order."""
    return [reading for reading in readings if reading > limit]
''',
    bug=("reading > limit", "reading >= limit"),
    caller='''def @CALLER@(readings, limit):
    """True when some reading exceeds `limit` (a reading exactly at the limit is fine)."""
    return len(@HELPER@(readings, limit)) > 0
''',
    helper_names=("above_limit", "over_threshold", "exceeding"),
    caller_names=("should_alert", "over_limit", "needs_alarm"),
    helper_cases=_above_cases, caller_cases=_above_caller_cases,
    summary="treats readings exactly at the limit as above it",
    hint="it raises alarms when nothing is actually over the limit",
)


def _band_cases(rng: random.Random) -> list[Case]:
    cuts = sorted(rng.sample(range(40, 95, 5), 3))
    return [Case("exactly_on_a_cutoff", (cuts[1], cuts)), Case("between_cutoffs", (cuts[0] + 1, cuts)),
            Case("below_all_cutoffs", (cuts[0] - 1, cuts)), Case("above_all_cutoffs", (cuts[2] + 3, cuts))]


def _band_caller_cases(rng: random.Random) -> list[Case]:
    cuts = sorted(rng.sample(range(40, 95, 5), 3))
    labels = rng.choice([["F", "C", "B", "A"], ["none", "bronze", "silver", "gold"], ["low", "fair", "good", "top"]])
    return [Case("scores_on_cutoffs", ([cuts[0], cuts[2] + 2, cuts[2]], cuts, labels)),
            Case("scores_between_cutoffs", ([cuts[0] + 1, cuts[1] + 2, cuts[0] - 4], cuts, labels))]


BAND = Variant(
    family="comparison", name="band",
    helper='''def @HELPER@(score, cutoffs):
    """The band of a score: how many of the cutoffs it reaches or passes."""
    band = 0
    for cutoff in sorted(cutoffs):
        if score >= cutoff:
            band += 1
    return band
''',
    bug=("score >= cutoff", "score > cutoff"),
    caller='''def @CALLER@(scores, cutoffs, labels):
    """The label of each score's band: labels[band] (labels has one more entry than cutoffs)."""
    return [labels[@HELPER@(score, cutoffs)] for score in scores]
''',
    helper_names=("band_of", "tier", "bracket"),
    caller_names=("grade_all", "label_scores", "assign_grades"),
    helper_cases=_band_cases, caller_cases=_band_caller_cases,
    summary="puts a score that is exactly on a cutoff in the band below",
    hint="some results get a lower grade than they earned",
)

VARIANTS = [WINDOW, TAIL, PAGE, BETWEEN, ABOVE, BAND]
