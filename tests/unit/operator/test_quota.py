"""A namespace's usage of the volume and its quota: the decision (`quota.check`) and the ledger
the store keeps, without a volume (the store on a real one: test_staging_tenancy.py)."""

from __future__ import annotations

import pytest
from lora_operator.rules import errors
from lora_operator.store import quota

GIB = 1024**3


@pytest.mark.parametrize(
    ("usage", "adding", "limit"),
    [
        (quota.Usage(0, 0), 10, None),
        (quota.Usage(5, 0), 5, 10),
        (quota.Usage(3, 2), 5, 10),
        (quota.Usage(20, 0), 0, 10),  # nothing added: allowed even over (a lowered quota)
    ],
    ids=["no-limit", "fills-it", "with-downloads", "adds-nothing"],
)
def test_what_fits_the_quota(usage: quota.Usage, adding: int, limit: int | None) -> None:
    quota.check("team-a", usage, adding, limit)  # raises when it does not fit


@pytest.mark.parametrize(
    ("usage", "adding", "limit"),
    [(quota.Usage(10, 0), 1, 10), (quota.Usage(4, 4), 3, 10), (quota.Usage(0, 0), 11, 10)],
    ids=["full", "downloads-count", "too-big-alone"],
)
def test_what_does_not_fit_the_quota(usage: quota.Usage, adding: int, limit: int) -> None:
    with pytest.raises(errors.QuotaExceeded) as e:
        quota.check("team-a", usage, adding, limit)
    assert not e.value.permanent and e.value.degrades_at_once
    assert e.value.reason == "QuotaExceeded"
    # The message says the usage, the limit, what is asked and what to do.
    assert f"namespace team-a uses {usage.total} bytes of its {limit} bytes quota" in str(e.value)
    assert f"needs {adding} bytes more" in str(e.value)
    assert "--namespace-quota" in str(e.value) and "Delete" in str(e.value)
    assert ("downloads in progress" in str(e.value)) == bool(usage.downloading)


@pytest.mark.parametrize(
    ("n", "text"),
    [
        (0, "0 bytes"),
        (1023, "1023 bytes"),
        (1536, "1.5 KiB (1536 bytes)"),
        (20 * GIB, f"20.0 GiB ({20 * GIB} bytes)"),
        (3 * 1024**4, f"3.0 TiB ({3 * 1024**4} bytes)"),
    ],
)
def test_sizes_read_as_a_person_reads_them(n: int, text: str) -> None:
    assert quota.size(n) == text


def test_a_file_counts_once_per_namespace_and_in_every_namespace_that_holds_it() -> None:
    told: list[tuple[str, int]] = []
    ledger = quota.Ledger(100, lambda ns, n: told.append((ns, n)))
    ledger.load({"a": {(1, 1): 10, (1, 2): 20}})
    assert ledger.loaded("a") and not ledger.loaded("b")
    ledger.commit("a", None, {(1, 1): 10})  # another revision linking the same file
    ledger.commit("b", None, {(1, 1): 10})  # another namespace holding it
    assert ledger.usages() == {"a": quota.Usage(30, 0), "b": quota.Usage(10, 0)}
    assert ledger.holds("a", (1, 2)) and not ledger.holds("b", (1, 2))
    assert told == [("a", 30), ("a", 30), ("b", 10)]
    # The whole volume read again (after a collection): what it does not name holds nothing.
    ledger.load({"b": {(1, 1): 10}}, every=True)
    assert ledger.usages() == {"b": quota.Usage(10, 0)}
    assert ledger.usage("a") == quota.Usage(0, 0)
    assert told[-2:] == [("a", 0), ("b", 10)]


def test_downloads_reserve_their_bytes_and_cannot_overcommit_together() -> None:
    ledger = quota.Ledger(100)
    ledger.load({"a": {(1, 1): 40}})
    first, second = object(), object()
    ledger.reserve("a", first, 30)
    ledger.reserve("a", second, 30)  # 40 + 30 + 30: full
    with pytest.raises(errors.QuotaExceeded, match="60 bytes of it downloads in progress"):
        ledger.reserve("a", second, 31)
    assert ledger.usage("a") == quota.Usage(40, 60)  # the refused growth reserved nothing
    ledger.reserve("b", object(), 100)  # another namespace's quota is its own
    # Publishing: the download's own reservation is what the revision takes over.
    ledger.admit("a", first, {(1, 2): 30})
    with pytest.raises(errors.QuotaExceeded):
        ledger.admit("a", first, {(1, 2): 30}, extra=1)
    ledger.commit("a", first, {(1, 2): 30})
    assert ledger.usage("a") == quota.Usage(70, 30)
    # Content the namespace holds already adds nothing, even when it is full.
    ledger.admit("a", None, {(1, 1): 40, (1, 2): 30})
    ledger.release("a", second)
    ledger.release("a", second)  # twice: nothing more
    assert ledger.usage("a") == quota.Usage(70, 0)


def test_no_limit_refuses_nothing() -> None:
    ledger = quota.Ledger(None)
    ledger.reserve("a", object(), 10 * 1024**5)
    ledger.admit("a", None, {(1, 1): 10 * 1024**5})
    assert ledger.usage("a").downloading == 10 * 1024**5
