"""The Faust transport each broker profile gets (no broker: the clients are built, not started)."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest

from servewatch.pipeline.settings import Settings
from servewatch.pipeline.streams.faust_app import faust_app


@pytest.mark.parametrize("profile, idempotent", [("kafka", True), ("tansu", False)])
async def test_the_workers_producer_is_idempotent_on_kafka_and_plain_on_tansu(profile: str, idempotent: bool) -> None:
    app = faust_app(Settings(broker="127.0.0.1:9", broker_profile=profile))
    client = app.producer._new_producer()  # what Faust starts, built without connecting
    try:
        # aiokafka keeps a transaction manager (producer id, sequence numbers) only when idempotent,
        # and refuses idempotence with any acks but "all".
        assert (client._txn_manager is not None) is idempotent
    finally:
        await client.stop()


def test_a_temp_data_dir_goes_with_its_app_and_a_configured_one_stays(tmp_path: Path) -> None:
    app = faust_app(Settings(broker="127.0.0.1:9"))
    made = Path(app.conf.datadir)
    assert made.is_dir() and made.name.startswith("servewatch-faust-")
    del app
    gc.collect()
    assert not made.exists()

    kept = faust_app(Settings(broker="127.0.0.1:9", data_dir=str(tmp_path)))
    del kept
    gc.collect()
    assert tmp_path.is_dir()
