"""The cluster scenario's driver, against a real simulator."""



from epd_proxy.bench.conversations import ChatSpec, make_conversations
from epd_proxy.bench.scenarios.cluster.drive import OracleClient, drive, instance_states
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
