"""Kafka SASL and TLS settings reach every client: Faust's, and each aiokafka
client servewatch opens. The embedded Tansu broker cannot check them here (its users live in
its in-process storage, and this build refuses --cert with --key), so these tests check
what each client is given, against Faust's own mapping of credentials to aiokafka."""

from __future__ import annotations

import ssl

import faust
import pytest
from faust.transport.drivers.aiokafka import credentials_to_aiokafka_auth

from servewatch.pipeline.cli.common import CommandError, load_settings
from servewatch.pipeline.kafka import PLAINTEXT, KafkaAuth, producer
from servewatch.pipeline.settings import Settings
from servewatch.pipeline.worker import create_app

SCRAM = {"security_protocol": "SASL_SSL", "sasl_mechanism": "SCRAM-SHA-512", "sasl_username": "sw",
         "sasl_password": "s3cret", "broker": "127.0.0.1:9"}  # fmt: skip


def test_plaintext_is_the_default_and_adds_nothing() -> None:
    assert KafkaAuth.from_settings(Settings()) == PLAINTEXT
    assert PLAINTEXT.client_options() == {"security_protocol": "PLAINTEXT"}


def test_sasl_scram_over_tls_reaches_faust_and_aiokafka_alike() -> None:
    settings = Settings(**SCRAM)  # type: ignore[arg-type]
    auth = KafkaAuth.from_settings(settings)
    options = auth.client_options()
    assert options["security_protocol"] == "SASL_SSL" and options["sasl_mechanism"] == "SCRAM-SHA-512"
    assert (options["sasl_plain_username"], options["sasl_plain_password"]) == ("sw", "s3cret")
    assert isinstance(options["ssl_context"], ssl.SSLContext)

    app, _ = create_app(settings)
    credentials = app.conf.broker_credentials
    assert isinstance(credentials, faust.SASLCredentials)
    faust_options = credentials_to_aiokafka_auth(credentials)
    assert {k: v for k, v in faust_options.items() if k != "ssl_context"} == {
        k: v for k, v in options.items() if k != "ssl_context"
    }
    assert isinstance(faust_options["ssl_context"], ssl.SSLContext)


async def test_tls_alone_and_an_aiokafka_client_built_with_it() -> None:
    auth = KafkaAuth.from_settings(Settings(security_protocol="SSL", broker="127.0.0.1:9"))
    client = producer("127.0.0.1:9", auth=auth).client
    assert client._security_protocol == "SSL" and isinstance(client._ssl_context, ssl.SSLContext)
    app, _ = create_app(Settings(security_protocol="SSL", broker="127.0.0.1:9"))
    assert isinstance(app.conf.broker_credentials, faust.SSLCredentials)


def test_the_password_stays_secret_in_settings() -> None:
    settings = Settings(**SCRAM)  # type: ignore[arg-type]
    assert "s3cret" not in repr(settings) and "s3cret" not in str(settings.model_dump())


@pytest.mark.parametrize(
    ("env", "says"),
    [
        ({"SERVEWATCH_SECURITY_PROTOCOL": "SASL_SSL"}, "needs sasl_username and sasl_password"),
        ({"SERVEWATCH_SASL_USERNAME": "sw", "SERVEWATCH_SASL_PASSWORD": "x"}, "security_protocol is not SASL"),
        ({"SERVEWATCH_SASL_MECHANISM": "MD5"}, "SERVEWATCH_SASL_MECHANISM"),
    ],
)
def test_inconsistent_security_settings_are_one_line(
    env: dict[str, str], says: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(CommandError) as raised:
        load_settings()
    assert says in str(raised.value) and "\n" not in str(raised.value)
