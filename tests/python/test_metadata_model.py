"""RdmaMetadata / SerializedDescriptor: the pydantic models whose JSON crosses the wire.

Dynamo 1.6.1: both are pydantic v2 BaseModels with extra="forbid", frozen=True; field order
descriptors, nixl_metadata, notification_key, operation_kind (and device, ptr, size); validators on
operation_kind (1..3, raising a bare TypeError, not a ValidationError), device, ptr (!= 0), size (>= 0).
"""
import json
from typing import Optional

import pydantic
import pytest

SAMPLE = ('{"descriptors":[{"device":"cpu","ptr":94065810693184,"size":4096},'
          '{"device":"cuda:1","ptr":140000000000000,"size":1}],'
          '"nixl_metadata":"b64:eJzLy6zICU4tckktrnFMT80rUWKAALM0","notification_key":'
          '"3c58128a-5dcb-4f59-92d4-baa04467fac3","operation_kind":1}')


def test_models_are_pydantic(nc):
    # Dynamo's examples embed RdmaMetadata as a field of their own pydantic request models.
    assert issubclass(nc.RdmaMetadata, pydantic.BaseModel)
    assert issubclass(nc.SerializedDescriptor, pydantic.BaseModel)
    assert list(nc.RdmaMetadata.model_fields) == [
        "descriptors", "nixl_metadata", "notification_key", "operation_kind"]
    assert list(nc.SerializedDescriptor.model_fields) == ["device", "ptr", "size"]


def test_defaults(nc):
    assert nc.RdmaMetadata().model_dump_json() == (
        '{"descriptors":[],"nixl_metadata":"","notification_key":"","operation_kind":0}')
    sd = nc.SerializedDescriptor()
    assert (sd.device, sd.ptr, sd.size) == ("cpu", 0, 0)  # defaults are not validated


def test_sample_json_round_trip_is_byte_exact(nc):
    md = nc.RdmaMetadata.model_validate_json(SAMPLE)
    assert md.model_dump_json() == SAMPLE
    assert md.operation_kind == 1
    assert [d.size for d in md.descriptors] == [4096, 1]
    assert isinstance(md.descriptors[0], nc.SerializedDescriptor)
    # dict form, as Dynamo's workers ship it (model_dump() in a request, model_validate() back)
    d = md.model_dump()
    assert d == json.loads(SAMPLE)
    assert nc.RdmaMetadata.model_validate(d).model_dump_json() == SAMPLE


def test_key_order_normalised(nc):
    shuffled = ('{"operation_kind":2,"notification_key":"k","nixl_metadata":"b64:",'
                '"descriptors":[{"size":3,"ptr":9,"device":"cuda:0"}]}')
    assert nc.RdmaMetadata.model_validate_json(shuffled).model_dump_json() == (
        '{"descriptors":[{"device":"cuda:0","ptr":9,"size":3}],"nixl_metadata":"b64:",'
        '"notification_key":"k","operation_kind":2}')


def test_string_escaping_matches_pydantic(nc):
    md = nc.RdmaMetadata(operation_kind=1, notification_key='é\u2028"\\/\x01')
    # pydantic-core: non-ASCII raw UTF-8, `/` unescaped, control chars as \u00XX
    assert md.model_dump_json() == (
        '{"descriptors":[],"nixl_metadata":"","notification_key":"é\u2028\\"\\\\/\\u0001",'
        '"operation_kind":1}')


def test_indent(nc):
    assert nc.RdmaMetadata(operation_kind=1).model_dump_json(indent=2) == (
        '{\n  "descriptors": [],\n  "nixl_metadata": "",\n  "notification_key": "",\n'
        '  "operation_kind": 1\n}')


def test_extra_fields_forbidden(nc):
    with pytest.raises(pydantic.ValidationError):
        nc.RdmaMetadata.model_validate_json('{"operation_kind":1,"x":1}')
    with pytest.raises(pydantic.ValidationError):
        nc.RdmaMetadata(operation_kind=1, x=1)
    with pytest.raises(pydantic.ValidationError):
        nc.SerializedDescriptor(ptr=1, foo=2)
    with pytest.raises(pydantic.ValidationError):
        nc.RdmaMetadata.model_validate_json(
            '{"descriptors":[{"device":"cpu","ptr":1,"size":1,"extra":0}],"operation_kind":1}')


def test_frozen(nc):
    md = nc.RdmaMetadata(operation_kind=1)
    with pytest.raises(pydantic.ValidationError):
        md.notification_key = "x"
    sd = nc.SerializedDescriptor(ptr=1)
    with pytest.raises(pydantic.ValidationError):
        sd.ptr = 5
    assert nc.SerializedDescriptor(ptr=1) == nc.SerializedDescriptor(ptr=1)
    hash(sd)  # frozen, scalar fields: hashable


@pytest.mark.parametrize("value", [0, 4, -1, 100])
def test_operation_kind_out_of_range_is_type_error(nc, value):
    # A TypeError inside a pydantic field_validator is not wrapped: it escapes as a bare TypeError.
    with pytest.raises(TypeError, match="operation_kind"):
        nc.RdmaMetadata(operation_kind=value)
    with pytest.raises(TypeError, match="operation_kind"):
        nc.RdmaMetadata.model_validate_json(f'{{"operation_kind":{value}}}')
    with pytest.raises(TypeError, match="operation_kind"):
        nc.RdmaMetadata.model_validate({"operation_kind": value})


@pytest.mark.parametrize("value", [1, 2, 3])
def test_operation_kind_accepted(nc, value):
    # 3 is accepted although OperationKind has no member 3 (validator checks 1..3).
    assert nc.RdmaMetadata(operation_kind=value).operation_kind == value


def test_lax_integers(nc):
    # pydantic lax mode: numeric strings, integral floats and bools become ints.
    assert nc.RdmaMetadata.model_validate_json('{"operation_kind":"1"}').operation_kind == 1
    assert nc.RdmaMetadata.model_validate_json('{"operation_kind":2.0}').operation_kind == 2
    assert nc.SerializedDescriptor(ptr="12").ptr == 12
    assert nc.SerializedDescriptor(ptr=True).ptr == 1
    with pytest.raises(pydantic.ValidationError):
        nc.SerializedDescriptor(ptr=12.5)
    assert nc.RdmaMetadata(operation_kind=nc.OperationKind.WRITE).model_dump()["operation_kind"] == 2


def test_big_and_negative_ptr(nc):
    # ptr is an unbounded Python int in Dynamo; only 0 is refused.
    assert nc.SerializedDescriptor(ptr=2 ** 63).model_dump_json() == (
        '{"device":"cpu","ptr":9223372036854775808,"size":0}')
    assert nc.SerializedDescriptor(ptr=2 ** 64 - 1).ptr == 2 ** 64 - 1
    assert nc.SerializedDescriptor(ptr=-1).ptr == -1


def test_serialized_descriptor_validators(nc):
    with pytest.raises(pydantic.ValidationError, match="ptr"):
        nc.SerializedDescriptor(ptr=0)
    with pytest.raises(pydantic.ValidationError, match="size"):
        nc.SerializedDescriptor(ptr=1, size=-1)
    assert nc.SerializedDescriptor(ptr=1, size=0).size == 0
    for ok, norm in [(" CUDA:1 ", "cuda:1"), ("CPU", "cpu"), ("xpu", "xpu"), ("cudaxyz", "cudaxyz")]:
        assert nc.SerializedDescriptor(ptr=1, device=ok).device == norm
    for bad in ["host", "cpu:0", "gpu", "", "tpu"]:
        with pytest.raises(pydantic.ValidationError, match="device"):
            nc.SerializedDescriptor(ptr=1, device=bad)
    with pytest.raises(pydantic.ValidationError):
        nc.SerializedDescriptor(ptr=1, device=5)
    with pytest.raises(pydantic.ValidationError):
        nc.SerializedDescriptor.model_validate_json('{"ptr":1,"device":null}')
    with pytest.raises(TypeError):
        nc.SerializedDescriptor("cpu", 1, 2)  # keyword-only, like every pydantic model


def test_invalid_json_is_validation_error(nc):
    with pytest.raises(pydantic.ValidationError):
        nc.RdmaMetadata.model_validate_json('{"operation_kind":1} x')
    with pytest.raises(pydantic.ValidationError):
        nc.RdmaMetadata.model_validate_json("not json")
    with pytest.raises(pydantic.ValidationError):
        nc.RdmaMetadata.model_validate_json('{"notification_key":5,"operation_kind":1}')
    # ValidationError is a ValueError, so `except ValueError` catches it
    assert issubclass(pydantic.ValidationError, ValueError)


def test_descriptors_accept_dicts_and_tuples(nc):
    md = nc.RdmaMetadata(descriptors=[{"ptr": 1, "size": 2}], operation_kind=1)
    assert isinstance(md.descriptors[0], nc.SerializedDescriptor)
    md = nc.RdmaMetadata(descriptors=(nc.SerializedDescriptor(ptr=1),), operation_kind=1)
    assert isinstance(md.descriptors, list)


def test_embedded_in_user_model(nc):
    # The pattern of Dynamo's multimodal examples: `serialized_request: Optional[RdmaMetadata]`.
    class Request(pydantic.BaseModel):
        request_id: str
        serialized_request: Optional[nc.RdmaMetadata] = None

    r = Request(request_id="r1", serialized_request=nc.RdmaMetadata.model_validate_json(SAMPLE))
    js = r.model_dump_json()
    assert js == '{"request_id":"r1","serialized_request":' + SAMPLE + "}"
    back = Request.model_validate_json(js)
    assert isinstance(back.serialized_request, nc.RdmaMetadata)
    assert back.serialized_request.model_dump_json() == SAMPLE
    assert Request.model_validate(r.model_dump()).serialized_request.model_dump_json() == SAMPLE


def test_model_copy_update(nc):
    md = nc.RdmaMetadata.model_validate_json(SAMPLE)
    md2 = md.model_copy(update={"notification_key": "other"})
    assert md2.notification_key == "other" and md.notification_key != "other"
