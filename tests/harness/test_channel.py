"""The judge's end of a worker's pipes: every byte from a worker is untrusted."""

import os
import time

import pytest

from kforge.harness.channel import MAX_LINE, Channel, ChannelError


@pytest.fixture
def pipe():
    """(channel, write): the judge's channel, and a function writing bytes as the worker would."""
    reply_read, reply_write = os.pipe()
    command_read, command_write = os.pipe()
    channel = Channel(reply_read, command_write, "test")
    yield channel, lambda data: os.write(reply_write, data)
    for fd in (reply_write, command_read):
        os.close(fd)
    channel.close()


def soon() -> float:
    return time.monotonic() + 2.0


def test_a_message_is_one_json_object_a_line(pipe):
    channel, write = pipe
    write(b'{"a": 1}\n{"b"')
    assert channel.receive(soon()) == {"a": 1}
    write(b': [2]}\n')
    assert channel.receive(soon()) == {"b": [2]}


@pytest.mark.parametrize("line", [b"not json", b"[1, 2]", b"\xff\xfe", b"[" * 100_000 + b"]" * 100_000,
                                  b'{"n": ' + b"9" * 5000 + b"}"])
def test_what_is_not_a_json_object_is_malformed_not_an_exception(pipe, line):
    channel, write = pipe
    if len(line) > 60000:  # larger than the pipe's buffer: written from another process
        pid = os.fork()
        if pid == 0:
            write(line + b"\n")
            os._exit(0)
        with pytest.raises(ChannelError) as caught:
            channel.receive(soon())
        os.waitpid(pid, 0)
    else:
        write(line + b"\n")
        with pytest.raises(ChannelError) as caught:
            channel.receive(soon())
    assert caught.value.kind == "malformed"


def test_a_line_over_the_limit_is_malformed(pipe):
    channel, write = pipe
    pid = os.fork()
    if pid == 0:
        try:
            write(b"x" * (MAX_LINE + 2))
        finally:
            os._exit(0)
    with pytest.raises(ChannelError) as caught:
        channel.receive(soon())
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    assert caught.value.kind == "malformed" and str(MAX_LINE) in caught.value.reason


def test_silence_times_out_at_the_deadline(pipe):
    channel, _ = pipe
    started = time.monotonic()
    with pytest.raises(ChannelError) as caught:
        channel.receive(started + 0.2)
    assert caught.value.kind == "timeout" and 0.15 < time.monotonic() - started < 1.5


def test_a_closed_pipe_is_closed():
    reply_read, reply_write = os.pipe()
    command_read, command_write = os.pipe()
    channel = Channel(reply_read, command_write, "test")
    os.close(reply_write)
    with pytest.raises(ChannelError) as caught:
        channel.receive(soon())
    assert caught.value.kind == "closed"
    os.close(command_read)
    with pytest.raises(ChannelError) as caught:
        channel.send({"op": "x"})
    assert caught.value.kind == "closed"
    channel.close()
