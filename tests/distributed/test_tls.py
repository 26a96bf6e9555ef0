"""``refattn sweep`` and ``refattn verify`` over TLS (issue 40, item 5).

A throwaway CA (made with the ``cryptography`` package when it imports, else with the
``openssl`` command) signs one certificate for a dask scheduler and its worker on loopback and
one for the client. With dask's TLS settings for a client in the environment
(``DASK_DISTRIBUTED__COMM__TLS__CA_FILE``, ``..._CLIENT__CERT``, ``..._CLIENT__KEY``: the route
docs/tutorials/dask.md shows) a sweep runs through ``tls://127.0.0.1:PORT`` and its bundle
verifies, there and here. A client without a certificate of that CA is refused in one line
with exit 2 within its ``--timeout``: no TLS settings at all (refused before connecting), a
certificate of another CA (the scheduler ends the handshake), a setting naming a missing or
unreadable file; and with ``require-encryption`` set, a ``tcp://`` address.
"""

from __future__ import annotations

import datetime
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

distributed = pytest.importorskip("distributed")

import dask  # noqa: E402

from refattn.cli import main  # noqa: E402
from refattn.distributed.cluster import GRACE_SECONDS  # noqa: E402

#: seconds any one process of this file may run before it counts as hung (imports on a loaded
#: machine included; never asserted as a speed)
HUNG = 120
#: --timeout of the refused clients: a refusal is due within it plus the probe's grace
TIMEOUT = 3.0
SPEC = ('name = "tls"\n[[grid]]\nshape = [[1, 1, 1, 2, 3, 4, 4]]\n'
        'mask = ["none", "causal_upper_left"]\n')
#: the client's command: its exit code, and main()'s own seconds on stdout (imports excluded)
CLI = ("import sys, time; from refattn.cli import main; t = time.monotonic(); "
       "code = main(sys.argv[1:]); print(f'seconds {time.monotonic() - t:.3f}'); sys.exit(code)")
TLS_ENV = "DASK_DISTRIBUTED__COMM__"


# -- a throwaway CA and its certificates -----------------------------------------------------
def _with_cryptography(d: Path) -> None:
    """ca (self-signed), node and client (signed by ca), other_ca and stranger (signed by it):
    ``NAME.pem`` and ``NAME.key`` each, P-256 keys, valid for a day."""
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.timezone.utc)
    keys = {}

    def make(name: str, issuer: str | None) -> None:
        key = keys[name] = ec.generate_private_key(ec.SECP256R1())
        signer = keys[issuer] if issuer else key
        ca = issuer is None
        builder = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
            .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer or name)]))
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()),
                           critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(
                signer.public_key()), critical=False)
            .add_extension(x509.KeyUsage(
                digital_signature=not ca, content_commitment=False, key_encipherment=False,
                data_encipherment=False, key_agreement=False, key_cert_sign=ca, crl_sign=ca,
                encipher_only=False, decipher_only=False), critical=True))
        if not ca:
            builder = (builder.add_extension(x509.ExtendedKeyUsage(
                [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                critical=False).add_extension(x509.SubjectAlternativeName(
                    [x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                     x509.DNSName("localhost")]), critical=False))
        cert = builder.sign(signer, hashes.SHA256())
        (d / f"{name}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        (d / f"{name}.key").write_bytes(key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption()))

    for name, issuer in (("ca", None), ("node", "ca"), ("client", "ca"),
                         ("other_ca", None), ("stranger", "other_ca")):
        make(name, issuer)


def _with_openssl(d: Path, openssl: str) -> None:
    """The same files as :func:`_with_cryptography`, made by the ``openssl`` command."""
    def run(*args: str) -> None:
        subprocess.run([openssl, *args], cwd=d, check=True, capture_output=True, timeout=HUNG)

    leaf = d / "leaf.cnf"
    leaf.write_text("basicConstraints=critical,CA:FALSE\n"
                    "keyUsage=critical,digitalSignature\n"
                    "extendedKeyUsage=serverAuth,clientAuth\n"
                    "subjectAltName=IP:127.0.0.1,DNS:localhost\n"
                    "subjectKeyIdentifier=hash\nauthorityKeyIdentifier=keyid\n")
    ec = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")
    for ca in ("ca", "other_ca"):
        run("req", "-x509", *ec, "-keyout", f"{ca}.key", "-out", f"{ca}.pem", "-days", "1",
            "-subj", f"/CN={ca}", "-addext", "basicConstraints=critical,CA:TRUE",
            "-addext", "keyUsage=critical,keyCertSign,cRLSign")
    for name, ca in (("node", "ca"), ("client", "ca"), ("stranger", "other_ca")):
        run("req", *ec, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}")
        run("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key",
            "-set_serial", str(int.from_bytes(os.urandom(8), "big")), "-days", "1",
            "-extfile", leaf.name, "-out", f"{name}.pem")


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("tls")
    try:
        import cryptography  # noqa: F401
    except ImportError:
        openssl = shutil.which("openssl")
        if openssl is None:
            pytest.skip("a throwaway CA needs the cryptography package or the openssl command; "
                        "neither is here")
        _with_openssl(d, openssl)
    else:
        _with_cryptography(d)
    return d


# -- a TLS-only scheduler and worker on loopback -------------------------------------------------
def _wait_for(predicate, seconds: float, what: str, processes=()) -> object:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        value = predicate()
        if value:
            return value
        for process, log in processes:
            if process.poll() is not None:
                raise AssertionError(f"{what}: {process.args[2]} exited "
                                     f"{process.returncode}:\n{log.read_text()[-3000:]}")
        time.sleep(0.05)
    raise AssertionError(f"{what}: not within {seconds} s")


def _stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            process.kill()
    process.wait(timeout=60)


def _clean_env() -> dict[str, str]:
    """This environment without any dask comm setting of the user's."""
    return {k: v for k, v in os.environ.items() if not k.startswith(TLS_ENV)}


@pytest.fixture(scope="module")
def scheduler(certs, tmp_path_factory) -> Iterator[str]:
    """``tls://127.0.0.1:PORT`` of a dask scheduler (port chosen by the system) with one worker
    registered; both demand a certificate of ``ca`` from every peer."""
    d = tmp_path_factory.mktemp("cluster")
    file = d / "scheduler.json"
    tls = ["--tls-ca-file", str(certs / "ca.pem"), "--tls-cert", str(certs / "node.pem"),
           "--tls-key", str(certs / "node.key")]
    started = []
    try:
        log = d / "scheduler.log"
        with open(log, "w") as out:
            started.append((subprocess.Popen(
                [sys.executable, "-m", "distributed.cli.dask_scheduler", "--protocol", "tls",
                 "--host", "127.0.0.1", "--port", "0", "--dashboard-address", "127.0.0.1:0",
                 "--scheduler-file", str(file), *tls],
                stdout=out, stderr=subprocess.STDOUT, env=_clean_env()), log))
        _wait_for(lambda: file.exists() and file.read_text().strip(), HUNG, "scheduler file",
                  started)
        address = json.loads(file.read_text())["address"]
        assert address.startswith("tls://127.0.0.1:"), address
        log = d / "worker.log"
        with open(log, "w") as out:
            started.append((subprocess.Popen(
                [sys.executable, "-m", "distributed.cli.dask_worker", "--scheduler-file",
                 str(file), "--nthreads", "1", "--no-nanny", "--host", "127.0.0.1",
                 "--dashboard-address", "127.0.0.1:0", *tls],
                stdout=out, stderr=subprocess.STDOUT, env=_clean_env()), log))
        _wait_for(lambda: "Registered to:" in log.read_text(), HUNG, "worker registered",
                  started)
        yield address
    finally:
        for process, _ in reversed(started):
            _stop(process)


def _client_env(certs: Path, cert: str | None, ca: str = "ca") -> dict[str, str]:
    """The environment of a client with dask's TLS settings for ``cert`` (None: none)."""
    env = _clean_env()
    if cert is not None:
        env.update({f"{TLS_ENV}TLS__CA_FILE": str(certs / f"{ca}.pem"),
                    f"{TLS_ENV}TLS__CLIENT__CERT": str(certs / f"{cert}.pem"),
                    f"{TLS_ENV}TLS__CLIENT__KEY": str(certs / f"{cert}.key")})
    return env


def _refattn(env: dict[str, str], *args: str) -> tuple[subprocess.CompletedProcess, float]:
    """``refattn ARGS`` in a fresh interpreter with ``env``; and main()'s own seconds."""
    run = subprocess.run([sys.executable, "-c", CLI, *args], capture_output=True, text=True,
                         env=env, timeout=HUNG, check=False)
    seconds = float(run.stdout.rsplit("seconds ", 1)[1]) if "seconds " in run.stdout else -1.0
    return run, seconds


def _one_line(run: subprocess.CompletedProcess, *needles: str) -> str:
    err = run.stderr
    assert run.returncode == 2, (run.returncode, err[-2000:])
    assert "Traceback" not in err and "Exception ignored" not in err, err[-2000:]
    assert err.count("\n") == 1 and err.endswith("\n"), err[-2000:]
    for needle in needles:
        assert needle in err, (needle, err)
    return err


# -- the tests -------------------------------------------------------------------------------
def test_a_sweep_runs_over_tls_and_its_bundle_verifies(certs, scheduler, tmp_path, capsys):
    spec = tmp_path / "s.toml"
    spec.write_text(SPEC)
    out = tmp_path / "b"
    env = _client_env(certs, "client")
    run, seconds = _refattn(env, "sweep", str(spec), "--out", str(out), "--scheduler",
                            scheduler, "--timeout", "10", "--quiet")
    assert run.returncode == 0, run.stderr[-3000:]
    assert "2 case(s)" in run.stdout and (out / "manifest.json").is_file(), run.stdout
    verified, _ = _refattn(env, "verify", str(out), "--no-gradcheck", "--scheduler", scheduler,
                           "--timeout", "10", "--quiet")
    assert verified.returncode == 0 and "PASS" in verified.stdout, verified.stderr[-3000:]
    with capsys.disabled():
        print(f"\nsweep over {scheduler}: {seconds:.2f} s in main()")
    capsys.readouterr()
    assert main(["verify", str(out), "--no-gradcheck", "--quiet"]) == 0  # here, not the cluster
    assert capsys.readouterr().out.rstrip().endswith("PASS")


@pytest.mark.parametrize("client", ["no_tls_settings", "another_cas_certificate"])
def test_a_client_without_a_certificate_of_the_ca_is_refused_in_one_line(certs, scheduler,
                                                                         tmp_path, client,
                                                                         capsys):
    spec = tmp_path / "s.toml"
    spec.write_text(SPEC)
    if client == "no_tls_settings":
        env = _client_env(certs, None)
        needles = (f"--scheduler {scheduler}: a tls:// scheduler needs dask's TLS settings "
                   "for a client", "DASK_DISTRIBUTED__COMM__TLS__CA_FILE")
    else:
        env = _client_env(certs, "stranger", ca="other_ca")
        needles = (f"--scheduler {scheduler}: no dask scheduler answered within {TIMEOUT:g} s",)
    run, seconds = _refattn(env, "sweep", str(spec), "--out", str(tmp_path / "b"),
                            "--scheduler", scheduler, "--timeout", f"{TIMEOUT:g}")
    err = _one_line(run, *needles)
    with capsys.disabled():
        print(f"\n{client}: refused after {seconds:.2f} s: {err.strip()}")
    # connect's documented contract (not a speed): a probe is given up within timeout + grace
    assert 0 <= seconds < TIMEOUT + GRACE_SECONDS, seconds
    assert not (tmp_path / "b").exists()


@pytest.mark.parametrize("setting", ["missing_ca_file", "cert_is_a_directory",
                                     "unreadable_key", "not_pem"])
def test_tls_settings_that_do_not_load_are_named_before_connecting(certs, tmp_path, setting,
                                                                   capsys):
    """No scheduler is needed: nothing connects (the port is one nobody listens on)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        address = f"tls://127.0.0.1:{s.getsockname()[1]}"
    ca, cert, key = (str(certs / n) for n in ("ca.pem", "client.pem", "client.key"))
    match setting:
        case "missing_ca_file":
            ca = str(tmp_path / "nowhere.pem")
            needle = (f"distributed.comm.tls.ca-file (DASK_DISTRIBUTED__COMM__TLS__CA_FILE) "
                      f"is {ca}: no such file")
        case "cert_is_a_directory":
            cert = str(tmp_path)
            needle = f"is {cert}: not a regular file"
        case "unreadable_key":
            if os.geteuid() == 0:
                pytest.skip("root reads a file of mode 000")
            key = str(tmp_path / "client.key")
            shutil.copy(certs / "client.key", key)
            os.chmod(key, 0)
            needle = f"is {key}: not readable"
        case "not_pem":
            ca = str(tmp_path / "ca.pem")
            Path(ca).write_text("not a certificate\n")
            needle = "they do not load ("
        case _:
            raise AssertionError(setting)
    spec = tmp_path / "s.toml"
    spec.write_text(SPEC)
    capsys.readouterr()
    with dask.config.set({"distributed.comm.tls.ca-file": ca,
                          "distributed.comm.tls.client.cert": cert,
                          "distributed.comm.tls.client.key": key}):
        code = main(["sweep", str(spec), "--out", str(tmp_path / "b"), "--scheduler", address,
                     "--timeout", f"{TIMEOUT:g}"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert f"--scheduler {address}: a tls:// scheduler needs dask's TLS settings" in err, err
    assert needle in err, err


def test_require_encryption_refuses_a_tcp_address(tmp_path, capsys):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        address = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    spec = tmp_path / "s.toml"
    spec.write_text(SPEC)
    capsys.readouterr()
    with dask.config.set({"distributed.comm.require-encryption": True}):
        code = main(["sweep", str(spec), "--out", str(tmp_path / "b"), "--scheduler", address,
                     "--timeout", f"{TIMEOUT:g}"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert f"--scheduler {address}: no dask scheduler answered" in err, err
    assert "encrypt" in err.lower(), err
