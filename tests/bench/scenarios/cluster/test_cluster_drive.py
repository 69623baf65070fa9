"""The cluster scenario's driver, against a real simulator."""



from epd_proxy.bench.conversations import ChatSpec, make_conversations
from epd_proxy.bench.scenarios.cluster.drive import (
    DirectClient,
    OracleClient,
    drive,
    instance_states,
    kv_metric_lines,
    sim_post,
)
from epd_proxy.bench.scenarios.cluster.evaluate import cluster_counters
from epd_proxy.bench.targets import SimInfo
from epd_proxy.sim import SimCluster, SimConfig, expected_text


# -- the driver, against a real simulator ------------------------------------------------------------
async def test_each_turn_carries_the_answer_received_and_a_failure_ends_its_conversation():
    spec = ChatSpec(conversations=3, turns=3, system_prompts=1, system_words=20, user_words=5, max_tokens=6,
                    image_share=0.0, think_s=0.0, seed=3)
    convs = make_conversations(spec)
    async with SimCluster(prefill=2, decode=2, config=SimConfig(itl_ms=0.5, record_responses=False)) as cl:
        sim = SimInfo(encode=[], prefill=cl.urls("prefill"), decode=cl.urls("decode"))
        client = OracleClient(sim)
        await client.start()
        try:
            before = await instance_states(sim)
            # Conversation 1 is pinned to the second prefill: its first turn fails there, and the
            # conversation stops (its next prompt would need that answer).
            cl.instances("prefill")[1].inject("status=503", times=1)
            tally = await drive(spec, convs, [], 50.0, client)
            after = await instance_states(sim)
        finally:
            await client.close()
        s = tally.summary()
        assert s["requests"] == 7 and s["ok"] == 6 and s["errors"] == 1 and s["unsent_turns"] == 2
        assert s["verify_errors"] == 0 and 1 <= s["max_live_conversations"] <= 3
        # What the decodes received: each later turn holds the earlier answers, as the simulator gave them.
        bodies = [r.json for r in cl.records("decode") if r.path == "/v1/chat/completions"]
        by_conv: dict = {}
        for b in bodies:
            cid = b["messages"][1]["content"].split("/")[0].strip("[")
            by_conv.setdefault(cid, []).append(b)
        full = [v for v in by_conv.values() if len(v) == 3]
        assert len(full) == 2
        for turns in full:
            turns.sort(key=lambda b: len(b["messages"]))
            for t in (1, 2):
                prev = {k: v for k, v in turns[t - 1].items() if k != "kv_transfer_params"}
                assert turns[t]["messages"][2 * t]["content"] == expected_text(prev)
        c = cluster_counters(before, after)
        # Pinned: conversations 0 and 2 on prefill 0, conversation 1 on prefill 1.
        assert c["requests"]["prefill"] == [6, 1]
        assert c["prefix_hit_rate"] > 0  # the shared system prompt and each conversation's history


async def test_a_failed_turn_is_sent_again_when_the_clients_retry_and_a_restart_is_a_crash_fault():
    spec = ChatSpec(conversations=3, turns=3, system_prompts=1, system_words=20, user_words=5, max_tokens=6,
                    image_share=0.0, think_s=0.0, seed=3)
    convs = make_conversations(spec)
    async with SimCluster(prefill=2, decode=2, config=SimConfig(itl_ms=0.5, record_responses=False)) as cl:
        sim = SimInfo(encode=[], prefill=cl.urls("prefill"), decode=cl.urls("decode"))
        client = DirectClient(sim)
        await client.start()
        try:
            # The restart as the benchmark asks for it: the next request prefill 1 receives crashes it
            # (caches emptied), and it is back 0.2 s later; the retry, 0.5 s on, finds it up.
            await sim_post(sim.prefill[1], "/sim/fault", {"spec": "crash=0.2", "times": 1})
            tally = await drive(spec, convs, [], 50.0, client, retries=2)
        finally:
            await client.close()
        s = tally.summary()
        assert s["ok"] == 9 and s["unsent_turns"] == 0 and s["retried"] >= 1
        assert s["errors"] == s["retried"] and s["requests"] == 9 + s["errors"]
        assert not cl.instances("prefill")[1].crashed


def test_kv_metric_lines_sum_series_over_workers():
    page = (b'# TYPE epd_proxy_routing_exact_total counter\n'
            b'epd_proxy_routing_exact_total{role="prefill",worker="0"} 5\n'
            b'epd_proxy_routing_exact_total{role="prefill",worker="1"} 7\n'
            b'epd_proxy_kv_events_restarts_total{url="http://p:1",rank="0"} 1\n'
            b'epd_proxy_requests_total{route="chat"} 99\n')
    assert kv_metric_lines(page) == {'epd_proxy_routing_exact_total{role="prefill"}': 12.0,
                                     'epd_proxy_kv_events_restarts_total{url="http://p:1",rank="0"}': 1.0}
