"""The client over HTTPS (issue 59): through a TLS-terminating proxy with a self-signed certificate in front of the
service (its real app over a stand-in index), TLS 1.3, whose session tickets make the socket readable before any
answer, and TLS 1.2; search, batch and image answer as over plain HTTP, an early answer (a 413) still stops the body,
and a certificate the client was not told to trust is one line."""

import ssl

import pytest

from cfir_jax.api.client import Client, ServiceError
from cfir_jax.core.errors import CfirError
from tests.helpers.sample_images import small_png
from tests.helpers.standin_service import serving
from tests.helpers.tls_proxy import self_signed, tls_proxy

VERSIONS = [ssl.TLSVersion.TLSv1_3, ssl.TLSVersion.TLSv1_2]


@pytest.fixture(scope="module")
def certificate(tmp_path_factory):
    return self_signed(tmp_path_factory.mktemp("tls"))


@pytest.fixture(scope="module")
def service():
    with serving(max_image_bytes=4096, max_text_bytes=1 << 20) as (url, _svc, _retriever):
        yield url


def _seen(result) -> tuple:
    return result.id, result.ids, [h.score for h in result.hits], result.version


@pytest.mark.parametrize("version", VERSIONS, ids=["tls1.3", "tls1.2"])
def test_search_batch_and_image_answer_over_tls_as_over_http(service, certificate, version):
    plain = Client(service, deadline_s=20)
    with tls_proxy(service, *certificate, version=version) as url:
        client = Client(url, deadline_s=20, ca=certificate[0])
        assert client.ready()
        text = "The Eiffel Tower in Paris at night. " * 2000  # 72 KB: more than one chunk of the body
        assert _seen(client.search(text, top_k=3)) == _seen(plain.search(text, top_k=3))
        docs = ["A report on the mill.", "The village and the school.", "A regatta."]
        assert [_seen(r) for r in client.search_many(docs, top_k=2)] == \
            [_seen(r) for r in plain.search_many(docs, top_k=2)]
        image = small_png()
        assert _seen(client.search(image=image, top_k=2)) == _seen(plain.search(image=image, top_k=2))
        assert _seen(client.search(image_id="img-b", top_k=2)) == _seen(plain.search(image_id="img-b", top_k=2))


@pytest.mark.parametrize("version", VERSIONS, ids=["tls1.3", "tls1.2"])
def test_an_early_refusal_over_tls_is_raised_and_the_call_ends(service, certificate, version):
    with tls_proxy(service, *certificate, version=version) as url:
        with pytest.raises(ServiceError, match=r"^body.* over the [\d,]+ ") as refused:
            Client(url, deadline_s=20, ca=certificate[0]).search(image=b"\x89PNG" + b"\x00" * (4 << 20))
        assert refused.value.status == 413


def test_a_context_is_used_as_it_stands(service, certificate):
    context = ssl.create_default_context(cafile=str(certificate[0]))
    with tls_proxy(service, *certificate) as url:
        assert Client(url, deadline_s=20, ca=context).search("The Louvre.", top_k=1).ids == ["img-a"]


def test_an_untrusted_certificate_is_one_line(service, certificate, tmp_path):
    with tls_proxy(service, *certificate) as url:
        with pytest.raises(CfirError, match=r"cannot reach the service over TLS \(.*certificate verify failed") as e:
            Client(url, deadline_s=20).search("The Louvre.")
        assert "\n" not in str(e.value)
        assert not Client(url, deadline_s=5).ready()
    (tmp_path / "not.pem").write_text("not a certificate")
    with pytest.raises(CfirError, match=r"^ca=.*not\.pem: cannot read CA certificates from it"):
        Client(url, ca=tmp_path / "not.pem")
