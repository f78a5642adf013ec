"""gateway.yaml's ``shared_state`` block: off unless given, a Redis URL when given."""

from prefixroute.edges.gateway.config import SharedStateConfig, load_config
from tests.unit.test_gateway_config import MINIMAL, error_of, secret_env, write  # noqa: F401


def test_shared_state_is_off_unless_configured(tmp_path):
    assert load_config(write(tmp_path, MINIMAL)).shared_state is None


def test_a_redis_url_turns_it_on_with_the_default_namespace(tmp_path):
    text = MINIMAL + "shared_state: {redis: 'redis://10.0.0.5:6379/2'}\n"
    assert load_config(write(tmp_path, text)).shared_state == SharedStateConfig(
        "redis://10.0.0.5:6379/2", "prefixroute")


def test_something_else_than_a_redis_url_is_refused_with_its_field(tmp_path):
    text = MINIMAL + "shared_state: {redis: 'http://10.0.0.5:6379'}\n"
    assert "shared_state.redis" in error_of(tmp_path, text)


def test_an_unknown_field_is_refused(tmp_path):
    text = MINIMAL + "shared_state: {redis: 'redis://h:1', url: 'redis://h:1'}\n"
    assert "url" in error_of(tmp_path, text)
