"""`flywheel demo`: the main job, end to end, as far as it is built.

Today that is the foundation of the loop: the local stack comes up (a real Kafka broker,
the topics, the SQL schema), and one completion record and its feedback event make the
trip through the real broker and back, decoded with the shared message schemas. Serving,
the sink, the learner and rollouts extend this as they land.
"""

from __future__ import annotations

import time
import uuid

from rich.console import Console
from rich.table import Table

from feedback import bus
from feedback.schemas import CompletionChoice, CompletionRecord, FeedbackEvent, decode, encode, key_of
from ops import stack
from ops.config import FlywheelSettings


def run(s: FlywheelSettings, console: Console) -> int:
    with console.status("starting the stack") as status:
        r = stack.up(s, status.update)
    console.print(f"stack up: Kafka {s.kafka.bootstrap}, database {r.database} (revision {r.revision})")

    completion_id = f"demo-{uuid.uuid4().hex[:12]}"
    record = CompletionRecord(
        completion_id=completion_id,
        model_version=0,
        user_hash="demo-user",
        language="python",
        filepath="demo.py",
        prompt_token_ids=[1, 2, 3],
        choices=[CompletionChoice(index=0, token_ids=[4, 5], logprobs=[-0.1, -0.7], text="pass")],
        latency_ms=0.0,
    )
    event = FeedbackEvent(completion_id=completion_id, type="select", accepted_chars=4)

    producer = bus.producer(s.kafka)
    t0 = time.perf_counter()
    for topic, msg in ((bus.COMPLETIONS, record), (bus.EVENTS, event)):
        producer.send(topic, key=key_of(msg), value=encode(msg)).get(timeout=30)
    producer.close()

    consumer = bus.consumer(s.kafka, bus.COMPLETIONS, bus.EVENTS, group_id=f"flywheel-demo-{uuid.uuid4().hex[:8]}", consumer_timeout_ms=30_000)
    seen: dict[str, object] = {}
    for m in consumer:
        if m.key == completion_id.encode():
            seen[m.topic] = decode(CompletionRecord if m.topic == bus.COMPLETIONS else FeedbackEvent, m.value)
        if len(seen) == 2:
            break
    consumer.close()
    elapsed_ms = (time.perf_counter() - t0) * 1000

    table = Table("topic", "key", "message", "round trip")
    for topic, msg in seen.items():
        table.add_row(topic, completion_id, type(msg).__name__, "decoded, identical" if msg in (record, event) else "DIFFERENT")
    console.print(table)
    ok = seen.get(bus.COMPLETIONS) == record and seen.get(bus.EVENTS) == event
    console.print(
        f"{'[green]round trip ok[/]' if ok else '[red]round trip failed[/]'}: "
        f"{len(seen)}/2 messages back through the broker in {elapsed_ms:.0f} ms"
    )
    console.print("next: `flywheel status` shows the stack; `flywheel down` stops the broker (data is kept)")
    return 0 if ok else 1
