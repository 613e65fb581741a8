"""Shared bookings (`gorgo.core.peers`): a peer's request counted like one's own, released once,
expired when its router never closes it, moved on a retry, followed through a reload; the
message format refuses anything malformed whole."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from gorgo.core.decision import Decision
from gorgo.core.features import extract_features
from gorgo.core.fleet import FleetError, parse_fleet
from gorgo.core.peers import CLOSED, ECHO_S, OPENED, PEER_LIVE_S, Booking, decode, encode, hello
from gorgo.core.router import Router

DOC = {"name": "f", "regions": {"a": {}}, "timeouts": {"request_s": 60},
       "replicas": [{"name": f"r{i}", "region": "a", "address": f"127.0.0.1:{9100 + i}",
                     "engine": "sglang"} for i in range(3)],
       "sharing": {"nats": "nats://127.0.0.1:4222"}}


def pair() -> tuple[Router, Router]:
    spec = parse_fleet(DOC)
    a, b = Router(spec, id_prefix="a"), Router(spec, id_prefix="b")
    a.share()
    b.share()
    return a, b


def deliver(src: Router, dst: Router, now: float = 0.0) -> None:
    """What the bus does: src's bookings, through the wire format, applied at dst."""
    assert src.outbox is not None
    for message in encode(src.router_id, src.outbox):
        for b in decode(message):
            dst.apply_peer(b, now)
    src.outbox.clear()


def features(router: Router, text: str):
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": text}]}).encode()
    return extract_features("/v1/chat/completions", {}, body, router.state.tok)


def test_a_peers_request_counts_as_ones_own_until_it_closes() -> None:
    a, b = pair()
    f = features(a, "shared " * 500)
    d = a.route(f, 0.0)
    assert isinstance(d, Decision)
    deliver(a, b)
    s = b.state
    assert s.inflight_reqs.tolist() == a.state.inflight_reqs.tolist()
    assert s.inflight_uncached[d.replica] == d.uncached_tokens
    assert s.waiting_tokens()[d.replica] == pytest.approx(a.state.waiting_tokens()[d.replica])
    assert s.matched_blocks(f)[d.replica] == len(f.block_hashes)  # its prefix, for b's next
    assert b.outbox == []  # b republishes nothing of a's
    a.complete(d.id)
    deliver(a, b)
    assert s.inflight_reqs.sum() == 0 and s.inflight_uncached.sum() == 0
    assert (b.peers.applied, b.peers.ignored, len(b.peers)) == (2, 0, 0)


def heard_from(router: Router, peer: str, now: float) -> None:
    """``router`` received a booking of ``peer`` at ``now`` (its open and its close)."""
    router.apply_peer(Booking(peer, f"{peer}-1", OPENED, "r0", 5, 5), now)
    router.apply_peer(Booking(peer, f"{peer}-1", CLOSED, "r0"), now)


def test_own_choices_echo_once_per_live_peer_until_their_bookings_can_come() -> None:
    a, _ = pair()
    heard_from(a, "b", 0.0)
    heard_from(a, "c", 0.5)
    s = a.state
    f = features(a, "burst " * 400)
    d = a.route(f, 1.0)
    assert isinstance(d, Decision) and a.peers.live_peers(1.0) == 2
    i, u = d.replica, d.uncached_tokens
    assert s.inflight_reqs[i] == 3 and s.inflight_uncached[i] == 3 * u  # its own and 2 echoes
    assert s.own_backlog(i) == pytest.approx(3 * u)
    assert s.matched_blocks(f)[i] == len(f.block_hashes)  # blocks: its own booking only
    a.tick(1.0 + ECHO_S)
    drained = s.prefill_rate[i] * ECHO_S
    assert s.inflight_reqs[i] == 1 and s.inflight_uncached[i] == u  # exactly its own again
    assert s.own_backlog(i) == pytest.approx(max(3 * u - drained, 0) - 2 * u, abs=1e-6)
    a.complete(d.id)
    assert s.inflight_reqs.sum() == 0 and s.inflight_uncached.sum() == 0


def test_an_echo_taken_back_after_a_scrape_leaves_what_was_sent_since() -> None:
    # The scrape starts the engine view (what this router sent since it) afresh, echo and all:
    # taking the echo back there too took away the next request's tokens instead.
    def sent_since_scrape(live_peer: bool) -> tuple[float, float]:
        a = Router(parse_fleet({**DOC, "replicas": DOC["replicas"][:1]}), id_prefix="a")
        a.share()
        if live_peer:
            heard_from(a, "b", 0.0)
        s = a.state
        d = a.route(features(a, "first " * 400), 0.0)
        assert isinstance(d, Decision)
        s.observe_engine(d.replica, 0.001, queue_reqs=3.0, running_reqs=1.0, kv_usage=0.1)
        a.route(features(a, "other " * 400), 0.002)
        a.tick(0.002 + ECHO_S)
        return float(s.sent_since_scrape.sum()), float(s._sent_left().sum())

    assert sent_since_scrape(True) == pytest.approx(sent_since_scrape(False))
    assert sent_since_scrape(False)[0] > 0


def test_no_echo_without_live_peers_or_sharing() -> None:
    a, _ = pair()
    f = features(a, "alone " * 400)
    assert a.route(f, 0.0) and a.state.inflight_reqs.sum() == 1  # never heard of a peer
    heard_from(a, "b", 0.0)
    assert a.route(f, PEER_LIVE_S + 1.0) and a.state.inflight_reqs.sum() == 2  # b fell silent
    quiet = Router(parse_fleet(DOC), id_prefix="q")  # sharing not started: no peers to echo
    heard_from(quiet, "b", 0.0)
    assert quiet.route(f, 0.0) and quiet.state.inflight_reqs.sum() == 1


@pytest.mark.parametrize(("me", "peers", "now", "turn_ms"), [
    ("b", {"a": 0.0, "c": 0.0}, 1.0, 2.0),  # one live peer ranks before it
    ("d", {"a": 0.0, "b": 0.5, "c": 0.9}, 1.0, 6.0),  # three do
    ("a", {"b": 0.0, "c": 0.0}, 1.0, 0.0),  # first in turn: no wait
    ("d", {"a": 0.0, "c": 0.0}, PEER_LIVE_S + 0.5, 0.0),  # they fell silent
])
def test_the_routers_of_one_moment_decide_in_turns_by_id(
    me: str, peers: dict[str, float], now: float, turn_ms: float,
) -> None:
    r = Router(parse_fleet(DOC), id_prefix=me)
    r.share()
    for peer, at in peers.items():
        heard_from(r, peer, at)
    assert r.stagger_s(now) == pytest.approx(turn_ms / 1000.0)


def test_a_turn_never_outlasts_a_quarter_of_envoys_message_timeout() -> None:
    doc = {**DOC, "timeouts": {"request_s": 60, "message_ms": 200},
           "sharing": {"nats": "nats://127.0.0.1:4222", "stagger_ms": 40}}
    r = Router(parse_fleet(doc), id_prefix="z")
    r.share()
    for peer in "abcd":
        heard_from(r, peer, 0.0)
    assert r.stagger_s(0.0) == pytest.approx(0.05)  # 4 x 40 ms held to 200 / 4


def test_no_turns_without_sharing_or_with_no_stagger() -> None:
    quiet = Router(parse_fleet(DOC), id_prefix="z")  # sharing not started
    heard_from(quiet, "a", 0.0)
    assert quiet.stagger_s(0.0) == 0.0
    off = Router(parse_fleet({**DOC, "sharing": {"nats": "nats://127.0.0.1:4222",
                                                 "stagger_ms": 0}}), id_prefix="z")
    off.share()
    heard_from(off, "a", 0.0)
    assert off.stagger_s(0.0) == 0.0


def test_a_reload_takes_the_echoes_back() -> None:
    a, _ = pair()
    heard_from(a, "b", 0.0)
    d = a.route(features(a, "reload " * 400), 0.0)
    assert isinstance(d, Decision) and a.state.inflight_reqs.sum() == 2
    a.reload(parse_fleet(DOC))
    assert a.state.inflight_reqs.sum() == 1 and len(a.echoes) == 0
    a.complete(d.id)
    assert a.state.inflight_reqs.sum() == 0


@pytest.mark.parametrize("booking", [
    Booking("x", "1", CLOSED, "r0"),  # a close without its open
    Booking("x", "2", OPENED, "elsewhere", 10, 10),  # a replica b does not know
    Booking("b", "3", OPENED, "r0", 10, 10),  # its own, echoed back by the bus
    # a prompt longer than the router admits: its tokens would stay in the replica's average
    # queue after it closed and price the replica out
    Booking("x", "4", OPENED, "r0", 2**40 - 1, 2**40 - 1),
    Booking("x", "5", OPENED, "r0", 10, 10, (), 128 * 4096 + 1),  # wider than a request can be
])
def test_what_cannot_be_applied_changes_nothing(booking: Booking) -> None:
    _, b = pair()
    b.apply_peer(booking, 0.0)
    assert b.state.inflight_reqs.sum() == 0 and len(b.peers) == 0


def test_a_repeated_open_counts_once_and_an_unclosed_one_expires() -> None:
    _, b = pair()
    opened = Booking("x", "1", OPENED, "r1", 100, 80)
    b.apply_peer(opened, 0.0)
    b.apply_peer(opened, 0.5)
    assert b.state.inflight_reqs.tolist() == [0, 1, 0] and b.peers.ignored == 1
    b.tick(59.0)
    assert b.state.inflight_reqs[1] == 1  # within the fleet's request timeout
    b.tick(60.0)  # its router died: released as the request would have been cut
    assert b.state.inflight_reqs.sum() == 0 and b.peers.expired == 1
    b.apply_peer(Booking("x", "1", CLOSED, "r1"), 61.0)  # the late close finds nothing
    assert b.state.inflight_reqs.sum() == 0


def test_a_retry_moves_the_booking_at_the_peers_too() -> None:
    a, b = pair()
    d = a.route(features(a, "retried " * 100), 0.0)
    assert isinstance(d, Decision)
    other = (d.replica + 1) % 3
    a.reassign(d.id, other)
    deliver(a, b)
    expected = [0, 0, 0]
    expected[other] = 1
    assert b.state.inflight_reqs.tolist() == expected
    demand = b.state.demand()
    d2 = a.route(features(a, "second " * 100), 0.0)  # then a request that only arrives
    deliver(a, b)
    assert d2 is not None and b.state.demand()[0] > demand[0]
    # ... the move was no second arrival at the peer either (its demand read 2x, retried)
    assert b.state.demand()[0] == pytest.approx(a.state.demand()[0])


def test_a_reload_keeps_the_bookings_on_kept_replicas() -> None:
    _, b = pair()
    b.apply_peer(Booking("x", "1", OPENED, "r2", 100, 80), 0.0)
    b.apply_peer(Booking("x", "2", OPENED, "r0", 100, 80), 0.0)
    doc = {**DOC, "replicas": [DOC["replicas"][2], DOC["replicas"][1]]}  # r0 removed, reordered
    b.reload(parse_fleet(doc))
    assert b.state.names == ["r2", "r1"] and b.state.inflight_reqs.tolist() == [1, 0]
    b.apply_peer(Booking("x", "1", CLOSED, "r2"), 1.0)
    assert b.state.inflight_reqs.sum() == 0 and len(b.peers) == 0


def test_sharing_is_not_changed_by_a_reload() -> None:
    _, b = pair()
    with pytest.raises(FleetError, match="sharing: cannot change on reload"):
        b.reload(parse_fleet({**DOC, "sharing": {"nats": "nats://elsewhere:4222"}}))


def test_a_hello_is_a_message_of_no_bookings() -> None:
    # Routers that neither ask nor answer read it as one with nothing to apply.
    assert decode(hello("r")) == [] and json.loads(hello("r")) == {"v": 1, "router": "r", "b": []}
    assert encode("r", []) == []  # bookings never make one


def test_the_wire_format_round_trips() -> None:
    out = [Booking("r", "d1", OPENED, "r0", 10, 4, (1, 2**64 - 1)),
           Booking("r", "d1", CLOSED, "r0"),
           Booking("r", "d2", OPENED, "r0", 10, 4, (), 6, 30),  # n = 3 of 2 prompts
           Booking("r", "d3", OPENED, "r0", 10, 4, (), 3)]  # a batch of 3 prompts, n = 1
    messages = encode("r", out)
    assert [b for m in messages for b in decode(m)] == out
    # One sequence over its prompt keeps the six-field row the routers before seqs read, and
    # the longer rows go in messages of their own, in order.
    assert [[len(r) for r in json.loads(m)["b"]] for m in messages] == [[6, 6], [8, 8]]


def test_a_retry_of_several_sequences_stays_in_the_peers_view() -> None:
    # The close and re-open of a retry went out re-open first (the longer rows were sent
    # first): the peer ignored the re-open as a repeat and the close removed the request.
    a, b = pair()
    f = features(a, "retried n=2 " * 100)
    d = a.route(replace(f, choices=2), 0.0)
    assert isinstance(d, Decision)
    deliver(a, b)
    other = (d.replica + 1) % 3
    a.reassign(d.id, other)
    deliver(a, b)
    expected = [0, 0, 0]
    expected[other] = 1
    assert b.state.inflight_reqs.tolist() == expected and b.peers.ignored == 0


def test_a_router_before_sequences_loses_no_close_to_a_longer_row() -> None:
    """An older router refuses a message with an eight-field row whole: one n > 1 request in
    the outbox cost it the closes of every other request (held until the request timeout)."""
    first = [Booking("r", "d1", OPENED, "r0", 10, 4)]
    then = [Booking("r", "d2", OPENED, "r0", 10, 4, (), 4, 40),  # n = 4
            Booking("r", "d1", CLOSED, "r0", 10, 4),
            Booking("r", "d2", CLOSED, "r0", 10, 4, (), 4, 40)]

    def older_router_reads(messages: list[bytes]) -> list[tuple[str, str]]:
        return [(b.decision_id, b.kind) for m in messages
                if all(len(row) == 6 for row in json.loads(m)["b"]) for b in decode(m)]
    seen = older_router_reads(encode("r", first)) + older_router_reads(encode("r", then))
    # d2's open is refused (its close then a no-op), d1's close arrives
    assert seen == [("d1", OPENED), ("d1", CLOSED), ("d2", CLOSED)]


def test_a_peers_request_of_several_sequences_books_them_all() -> None:
    a, b = pair()
    body = json.dumps({"model": "m", "prompt": "many " * 300, "n": 4}).encode()
    f = extract_features("/v1/completions", {}, body, a.state.tok)
    d = a.route(f, 0.0)
    assert isinstance(d, Decision)
    deliver(a, b)
    s = b.state
    assert s.inflight_reqs[d.replica] == 1
    assert s.inflight_seqs[d.replica] == 4 == a.state.inflight_seqs[d.replica]
    assert s.inflight_context[d.replica] == 4 * f.prompt_tokens
    assert (len(b.peers), b.peers.seqs) == (1, 4)
    a.complete(d.id)
    deliver(a, b)
    assert s.inflight_seqs.sum() == 0 and s.inflight_context.sum() == 0


@pytest.mark.parametrize("data", [
    b"{not json", b"[]", b'{"v": 2, "router": "r", "b": []}', b'{"v": 1, "b": []}',
    b'{"v": 1, "router": "r", "b": [["d", "open", "r0", 1, 1]]}',
    b'{"v": 1, "router": "r", "b": [["d", "maybe", "r0", 1, 1, []]]}',
    b'{"v": 1, "router": "r", "b": [["d", "open", "r0", -1, 1, []]]}',
    b'{"v": 1, "router": "r", "b": [["d", "open", "r0", 1, 1, [1.5]]]}',
    b'{"v": 1, "router": "r", "b": [["d", "open", "r0", 1, 1, [18446744073709551616]]]}',
    b'{"v": 1, "router": "r", "b": [["d", "open", "r0", true, 1, []]]}',
    b'{"v": 1, "router": "r", "b": [["d", "open", "r0", 10, 11, []]]}',  # more uncached
    b'{"v": 1, "router": "r", "b": [["d", "open", "r0", 10, 1, [], 0, 10]]}',  # no sequence
    b'{"v": 1, "router": "r", "b": [["d", "open", "r0", 10, 1, [], 2, 9]]}',  # under the prompt
    b'{"v": 1, "router": "r", "b": [["d", "open", "r0", 10, 1, [], 2, 21]]}',  # over n prompts
    b'{"v": 1, "router": "r", "b": [["d", "open", "r0", 10, 1, [], 2]]}',
    b'{"v": 1, "router": "r", "b": [["d", "open", "r0", 10, 1, [], 2.0, 20]]}',
    b"\xff\xfe",
])
def test_a_malformed_message_is_refused_whole(data: bytes) -> None:
    with pytest.raises(ValueError):
        decode(data)


@pytest.mark.parametrize(("sharing", "message"), [
    ({"nats": "http://bus:4222"}, "expected a NATS server URL"),
    ({"nats": "nats://bus:4222", "subject": "gorgo.*"}, "without wildcards"),
    ({"nats": "nats://bus:4222", "subject": "a..b"}, "without wildcards"),
    ({"nats": "nats://bus:4222", "topic": "x"}, "unknown field"),
    ({"nats": "nats://bus:4222", "stagger_ms": -1}, "must be >= 0"),
    ({"nats": "nats://bus:4222", "stagger_ms": 51}, "at most 50 ms"),
    ({"nats": "nats://bus:4222", "stagger_ms": "2ms"}, "expected a number"),
])
def test_fleet_sharing_errors(sharing: dict, message: str) -> None:
    with pytest.raises(FleetError, match=message):
        parse_fleet({**DOC, "sharing": sharing})


def test_fleet_sharing_defaults_to_the_fleets_subject() -> None:
    assert parse_fleet(DOC).sharing.subject == "gorgo.bookings.f"  # type: ignore[union-attr]
    assert parse_fleet(DOC).sharing.stagger_ms == 2.0  # type: ignore[union-attr]
    assert parse_fleet({k: v for k, v in DOC.items() if k != "sharing"}).sharing is None


def test_a_turn_goes_out_in_messages_within_the_servers_payload_limit() -> None:
    # 14 prompts of a megabyte and the closes of three earlier requests, in one loop turn, were
    # one message the NATS server refused (1 MiB): the closes were lost with it.
    hashes = tuple(range(2**63, 2**63 + 4000))  # ~80 KB of hashes each
    turn = [Booking("r", f"c{k}", CLOSED, "r0", 10, 4, hashes) for k in range(3)]
    turn += [Booking("r", f"o{k}", OPENED, "r1", 300_000, 300_000, hashes) for k in range(14)]
    turn.append(Booking("r", "huge", OPENED, "r2", 300_000, 300_000, tuple(range(60_000))))
    messages = encode("r", turn, max_bytes=200_000)
    assert len(messages) > 1 and all(len(m) <= 200_000 for m in messages)
    got = [b for m in messages for b in decode(m)]
    assert [(b.decision_id, b.kind) for b in got] == [(b.decision_id, b.kind) for b in turn]
    assert all(b.block_hashes == () for b in got if b.kind == CLOSED)  # a close needs none
    assert all(b.block_hashes == hashes for b in got[3:17])
    # too long for any message: sent without its last blocks, still counted in flight
    assert got[17].block_hashes == tuple(range(len(got[17].block_hashes)))
    assert 0 < len(got[17].block_hashes) < 60_000


def test_a_reload_that_removes_a_replica_closes_its_requests_for_the_peers() -> None:
    a, b = pair()
    ds = [a.route(features(a, f"reloaded {k} " * 100), 0.0) for k in range(6)]
    assert all(isinstance(d, Decision) for d in ds)
    deliver(a, b)
    assert b.state.inflight_reqs.sum() == 6
    gone = a.state.names[ds[0].replica]
    a.reload(parse_fleet({**DOC, "replicas": [r for r in DOC["replicas"] if r["name"] != gone]}))
    deliver(a, b)  # b's fleet kept the replica: it held those requests for the request timeout
    assert b.state.inflight_reqs[b.state.index[gone]] == 0
    for d in ds:
        a.complete(d.id)
    deliver(a, b)
    assert b.state.inflight_reqs.sum() == 0 and len(b.peers) == 0


def test_what_a_router_believes_of_its_peers_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    import gorgo.core.peers as peers_module

    monkeypatch.setattr(peers_module, "MAX_PEERS", 3)
    monkeypatch.setattr(peers_module, "MAX_PEER_BOOKINGS", 5)
    _, b = pair()
    # Bookings that apply to nothing make no live peer (200 made-up ids once held every
    # request for its turn behind them).
    for k in range(10):
        b.apply_peer(Booking(f"z{k}", "1", CLOSED, "r0"), 0.0)
        b.apply_peer(Booking(f"y{k}", "1", OPENED, "elsewhere", 10, 10), 0.0)
    assert b.peers.live_peers(0.0) == 0 and b.stagger_s(0.0) == 0.0
    for k in range(5):  # three peers are tracked, the fourth is ignored
        b.apply_peer(Booking(f"p{k}", "1", OPENED, "r0", 10, 10), 0.0)
    assert b.peers.live_peers(0.0) == 3 and len(b.peers) == 3
    for k in range(5):  # open bookings: five at most
        b.apply_peer(Booking("p0", f"more{k}", OPENED, "r1", 10, 10), 0.0)
    assert len(b.peers) == 5 and b.state.inflight_reqs.sum() == 5
    b.apply_peer(Booking("p0", "more0", CLOSED, "r1"), 0.0)
    assert len(b.peers) == 4


def test_a_deeply_nested_message_is_a_bad_message() -> None:
    with pytest.raises(ValueError, match="not JSON"):
        decode(b"[" * 200_000)
