"""How hetctl asks the system's OpenSSH client to reach a node, and what ``ssh -G`` says it will do.

hetctl never re-implements ssh_config: it writes one small client config of its own and
lets ``ssh`` read the user's files through ``Include``. In ssh_config the first value
obtained for an option wins, and ``-o`` options on the command line come before every
file, so the order of precedence is:

1. what the inventory sets on a node (``user``, ``port``, ``identity_file``,
   ``proxy_jump``): ``-o`` options on that node's command line only;
2. what the inventory's ``ssh:`` block sets (``host_key_policy``, ``connect_timeout``,
   ``keepalive``), ``BatchMode yes`` and ``LogLevel INFO``: the top of the generated file,
   so they also reach jump hosts (``ssh`` hands its ``-F`` file to the ssh it runs for
   ProxyJump). ``LogLevel INFO`` is ssh's own default: a user's ``QUIET``/``FATAL``/``ERROR``
   would hide the messages hetctl turns into errors (an unknown host key, a refused
   connection, a server that stopped answering), and ``VERBOSE``/``DEBUG`` would fill every
   command's stderr with ssh's chatter;
3. the user's ssh config, ``Include``d: ``ssh.config`` when set, else
   ``~/.ssh/config`` and the system file, exactly what ``ssh`` reads by default;
   nothing when ``ssh.config`` is null;
4. hetctl's built-in defaults (``Host *`` at the end): they apply only where neither
   the inventory nor the user's config gives a value.

The inventory's ``known_hosts`` is *added* to the user's ``UserKnownHostsFile`` list
(first, so that ``accept-new`` records new keys there): as a built-in default for hosts
whose config names no files, and, for a node, prepended to the list ``ssh -G`` reports.

A user config's ``StrictHostKeyChecking no`` (or ``off``) is read as ``accept-new`` for
the node itself (an ``-o`` option, after ``ssh -G`` told): unknown keys are accepted and
recorded as the user asked, but a changed key is refused, as it always is in hetctl
(``no`` would connect to it with a warning). Jump hosts keep the user's value: the node's
own key, checked end to end through them, is what protects the session.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import os
import pwd
import re
import shutil
import stat
import subprocess
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from hetctl.errors import ConfigError, HetctlError

DEFAULT_CONNECT_TIMEOUT = 10.0
DEFAULT_KEEPALIVE = 5.0
DEFAULT_HOST_KEY_POLICY = "strict"
SSH_CONFIG_DEFAULT = "~/.ssh/config"  # the inventory default: read what plain ssh reads
_POLICY = {"strict": "yes", "accept-new": "accept-new"}
CHECKING_OFF = ("false", "no", "off")  # StrictHostKeyChecking values (ssh -G says "false") that hetctl reads as accept-new
_G_TIMEOUT_S = 30.0
_MAX_HOPS = 8


# --- files hetctl writes ------------------------------------------------------------


def ssh_binary() -> str:
    """The ``ssh`` on PATH; a HetctlError saying what to install when there is none."""
    path = shutil.which("ssh")
    if not path:
        raise HetctlError("the OpenSSH client `ssh` is not on PATH", "install it (openssh-client) or use transport: local")
    return path


def control_dir() -> str:
    """A private (0700) per-user folder for control sockets and the generated config.

    ``$XDG_RUNTIME_DIR/hetctl`` when the session has one, else ``/tmp/hetctl-<uid>``.
    The path stays short (unix sockets allow ~104 bytes). A folder that is a symlink,
    owned by someone else or open to others is refused rather than used.
    """
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    base = runtime if runtime and os.path.isdir(runtime) and len(runtime) < 40 else "/tmp"
    path = os.path.join(base, "hetctl" if base == runtime else f"hetctl-{os.getuid()}")
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except OSError as e:
        raise HetctlError(f"cannot create {path}: {e.strerror}", "set XDG_RUNTIME_DIR to a private folder") from None
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise HetctlError(
            f"{path} is not a private folder of this user (a symlink, another owner, or open to others)",
            "remove it (it only holds hetctl's ssh control sockets) or set XDG_RUNTIME_DIR",
        )
    return path


def _file_value(value: str, what: str, *, tokens: bool = True) -> str:
    """``value`` as one ssh_config argument: quoted when it has spaces, ``%`` escaped where ssh expands tokens."""
    if any(c in value for c in '"\n\r\0'):
        raise ConfigError(f"{what} {value!r}: quotes and line breaks cannot be passed to ssh", "rename the file")
    if tokens:
        value = value.replace("%", "%%")
    return f'"{value}"' if any(c.isspace() for c in value) else value


def _includes(config: str | None) -> list[str]:
    """The user's config files to Include (see the module docstring)."""
    if config is None:
        return []
    if config == SSH_CONFIG_DEFAULT:  # where ssh itself looks: the password database's home, not $HOME
        return [os.path.join(pwd.getpwuid(os.getuid()).pw_dir, ".ssh", "config"), system_config()]
    return [config]


@functools.lru_cache(maxsize=1)
def system_config() -> str:
    """The system-wide ssh_config this ``ssh`` reads (Homebrew's differs from /etc/ssh's)."""
    try:
        out = subprocess.run([ssh_binary(), "-v", "-G", "-T", "hetctl-config-probe"], capture_output=True, text=True,
                             timeout=_G_TIMEOUT_S, stdin=subprocess.DEVNULL).stderr
    except (OSError, subprocess.TimeoutExpired):
        out = ""
    home_config = os.path.join(pwd.getpwuid(os.getuid()).pw_dir, ".ssh", "config")
    for path in re.findall(r"Reading configuration data (\S+)", out):
        if not path.endswith("/.ssh/config") and path != home_config:
            return path
    return "/etc/ssh/ssh_config"


def policy_value(host_key_policy: str | None) -> str:
    """``StrictHostKeyChecking`` for the inventory's ``host_key_policy`` where no user config is read
    (``ssh.config: null``): its own value, else the built-in default."""
    return _POLICY[host_key_policy or DEFAULT_HOST_KEY_POLICY]


def config_text(settings: Any) -> str:
    """The generated client config for an inventory's ``ssh:`` settings (see the module docstring)."""
    lines = ["# written by hetctl for one inventory's ssh: settings; see hetctl/remote/sshconfig.py", "BatchMode yes",
             "LogLevel INFO"]
    if settings.host_key_policy is not None:
        lines.append(f"StrictHostKeyChecking {_POLICY[settings.host_key_policy]}")
    if settings.connect_timeout is not None:
        lines.append(f"ConnectTimeout {_seconds(settings.connect_timeout)}")
    if settings.keepalive is not None:
        lines.append(f"ServerAliveInterval {_seconds(settings.keepalive) if settings.keepalive else 0}")
    lines += [f"Include {_file_value(p, 'ssh.config', tokens=False)}" for p in _includes(settings.config)]
    lines += [
        "Host *",
        f"  ConnectTimeout {_seconds(DEFAULT_CONNECT_TIMEOUT)}",
        f"  ServerAliveInterval {_seconds(DEFAULT_KEEPALIVE)}",
        f"  StrictHostKeyChecking {_POLICY[DEFAULT_HOST_KEY_POLICY]}",
    ]
    if settings.known_hosts:
        kh = _file_value(settings.known_hosts, "ssh.known_hosts")
        lines.append(f"  UserKnownHostsFile {kh} ~/.ssh/known_hosts ~/.ssh/known_hosts2")
    return "\n".join(lines) + "\n"


def _seconds(value: float) -> int:
    """ssh takes whole seconds; round up so a small timeout never becomes 0 (= none)."""
    return max(1, int(-(-float(value) // 1)))


def write_config(settings: Any) -> str:
    """Write :func:`config_text` into :func:`control_dir` (content-named, atomic) and return its path."""
    text = config_text(settings)
    folder = control_dir()
    path = os.path.join(folder, f"config-{hashlib.sha256(text.encode()).hexdigest()[:16]}")
    if not os.path.exists(path):
        from hetctl.node.runtime import write_atomic

        write_atomic(path, text.encode())  # 0600, as the control folder's other files
    return path


# --- options for one node -----------------------------------------------------------


def opt_value(value: str, what: str) -> str:
    """``value`` for one ``-o Key=value``: quoted when it has spaces; quotes and line breaks refused."""
    if any(c in value for c in '"\n\r\0'):
        raise ConfigError(f"{what} {value!r}: quotes and line breaks cannot be passed to ssh", f"fix {what} in the inventory")
    return f'"{value}"' if any(c.isspace() for c in value) else value


def node_options(node: Any) -> list[str]:
    """``-o`` options for what the inventory sets on ``node``; nothing for what it leaves to ssh_config.

    ``identity_file`` also sets ``IdentitiesOnly yes``: that key (or the agent's key
    matching a ``.pub`` file) is the one offered, so a wrong key fails clearly instead
    of an agent key logging in by accident.
    """
    opts: list[str] = []
    if node.user:
        opts += ["-o", f"User={opt_value(node.user, 'user')}"]
    if node.port:
        opts += ["-o", f"Port={int(node.port)}"]
    if node.identity_file:
        opts += ["-o", f"IdentityFile={opt_value(node.identity_file.replace('%', '%%'), 'identity_file')}",
                 "-o", "IdentitiesOnly=yes"]
    if node.proxy_jump:
        opts += ["-o", f"ProxyJump={opt_value(node.proxy_jump, 'proxy_jump')}"]
    return opts


# --- what ssh -G says -----------------------------------------------------------------


def parse_dump(text: str) -> dict[str, tuple[str, ...]]:
    """``ssh -G`` output → lower-case option → its values (several for identityfile, sendenv …)."""
    out: dict[str, list[str]] = {}
    for line in text.splitlines():
        key, _, value = line.strip().partition(" ")
        if key:
            out.setdefault(key.lower(), []).append(value)
    return {k: tuple(v) for k, v in out.items()}


def run_dump(config_file: str, options: Sequence[str], host: str, *, where: str) -> dict[str, tuple[str, ...]]:
    """Run ``ssh -F config_file OPTIONS -G host`` and parse it.

    Raises:
        ConfigError: ssh refused the configuration (its own message, naming the file and line).
    """
    argv = [ssh_binary(), "-F", config_file, *options, "-T", "-G", "--", host]
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=_G_TIMEOUT_S, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise HetctlError(f"{where}: `ssh -G` took over {_G_TIMEOUT_S:g} s", "check Match exec lines in the ssh config") from None
    if proc.returncode != 0:
        lines = [ln for ln in proc.stderr.splitlines() if ln.strip() and "Pseudo-terminal" not in ln]
        raise ConfigError(f"{where}: ssh cannot use its configuration: {'; '.join(lines[-2:]) or 'exit %d' % proc.returncode}",
                          "fix the ssh config (or the inventory's ssh: block)")
    return parse_dump(proc.stdout)


def _first(dump: Mapping[str, tuple[str, ...]], key: str, default: str = "") -> str:
    values = dump.get(key)
    return values[0] if values else default


def known_hosts_files(dump: Mapping[str, tuple[str, ...]], extra: str | None) -> tuple[str, ...]:
    """The node's UserKnownHostsFile list with the inventory's file first (added, never replacing)."""
    files = tuple(" ".join(dump.get("userknownhostsfile", ())).split())
    if extra and extra not in files:
        files = (extra, *files)
    return files


@dataclass(frozen=True)
class EffectiveSsh:
    """What ``ssh`` will use for one node, read from ``ssh -G`` with hetctl's own options.

    ``jump_path`` is filled by :func:`effective_settings` with ``jumps=True``: every
    hop as ``user@hostname:port``, outermost first, following each jump host's own
    ProxyJump as ssh does.
    """

    node: str
    host: str
    hostname: str
    user: str
    port: int
    proxy_jump: str | None
    proxy_command: str | None
    identity_files: tuple[str, ...]
    certificate_files: tuple[str, ...]
    known_hosts: tuple[str, ...]
    strict_host_key_checking: str
    connect_timeout: str
    server_alive_interval: str
    host_key_alias: str | None = None
    jump_path: tuple[str, ...] = ()
    raw: Mapping[str, tuple[str, ...]] = field(default_factory=dict, repr=False, compare=False)

    @property
    def address(self) -> str:
        """``user@hostname:port``, how messages name the endpoint."""
        return f"{self.user}@{self.hostname}:{self.port}"

    @property
    def where(self) -> str:
        """:attr:`address` plus the way there (``via bastion``, ``via ProxyCommand``)."""
        if self.proxy_jump:
            return f"{self.address} via {self.proxy_jump}"
        if self.proxy_command:
            return f"{self.address} via ProxyCommand"
        return self.address

    def to_dict(self) -> dict[str, Any]:
        """Plain data for ``--dry-run``/``--json`` (no secrets: ssh options only)."""
        return {
            "node": self.node, "host": self.host, "hostname": self.hostname, "user": self.user, "port": self.port,
            "proxy_jump": self.proxy_jump, "proxy_command": self.proxy_command, "jump_path": list(self.jump_path),
            "identity_files": list(self.identity_files), "certificate_files": list(self.certificate_files),
            "known_hosts": list(self.known_hosts), "strict_host_key_checking": self.strict_host_key_checking,
            "connect_timeout": self.connect_timeout, "server_alive_interval": self.server_alive_interval,
            "host_key_alias": self.host_key_alias,
        }


def host_key_checking(dump: Mapping[str, tuple[str, ...]]) -> str:
    """The StrictHostKeyChecking hetctl connects with: ssh -G's value, but ``accept-new`` where it is off
    (a changed key is always refused; see the module docstring)."""
    value = _first(dump, "stricthostkeychecking")
    return "accept-new" if value.lower() in CHECKING_OFF else value


def checking_off(dump: Mapping[str, tuple[str, ...]]) -> bool:
    """Whether the user's config turns host-key checking off for this host (hetctl then passes accept-new)."""
    return _first(dump, "stricthostkeychecking").lower() in CHECKING_OFF


def effective_from_dump(node: str, host: str, dump: Mapping[str, tuple[str, ...]], known_hosts: str | None) -> EffectiveSsh:
    """Build :class:`EffectiveSsh` from a parsed ``ssh -G`` dump."""
    jump = _first(dump, "proxyjump") or None
    command = _first(dump, "proxycommand") or None
    return EffectiveSsh(
        node=node, host=host, hostname=_first(dump, "hostname", host), user=_first(dump, "user"),
        port=int(_first(dump, "port", "22")),
        proxy_jump=None if (jump or "").lower() == "none" else jump,
        proxy_command=None if (command or "").lower() == "none" else command,
        identity_files=dump.get("identityfile", ()), certificate_files=dump.get("certificatefile", ()),
        known_hosts=known_hosts_files(dump, known_hosts),
        strict_host_key_checking=host_key_checking(dump),
        connect_timeout=_first(dump, "connecttimeout"), server_alive_interval=_first(dump, "serveraliveinterval"),
        host_key_alias=_first(dump, "hostkeyalias") or None, raw=dict(dump),
    )


def split_jump(item: str) -> tuple[str | None, str, int | None]:
    """One ProxyJump element ``[user@]host[:port]`` (or ``ssh://…``, ``[v6]:port``) → its parts."""
    rest = item.strip().removeprefix("ssh://")
    user, _, hostport = rest.rpartition("@")
    host, port = hostport, None
    if hostport.startswith("["):
        host, _, tail = hostport[1:].partition("]")
        port = tail[1:] if tail.startswith(":") else None
    elif hostport.count(":") == 1:
        host, port = hostport.split(":")
    return user or None, host, int(port) if port and port.isdigit() else None


def jump_path(config_file: str, proxy_jump: str | None, where: str, depth: int = 0) -> tuple[str, ...]:
    """Every hop of ``proxy_jump`` as ``user@hostname:port``, outermost first.

    ``ssh -J a,b`` reaches ``b`` through ``a``, and ``a`` the way its own config says
    (its ProxyJump too); that is what is followed here, one ``ssh -G`` per hop.
    """
    if not proxy_jump or proxy_jump.lower() == "none" or depth > _MAX_HOPS:
        return ()
    hops: list[str] = []
    for i, item in enumerate(proxy_jump.split(",")):
        user, host, port = split_jump(item)
        opts = (["-l", user] if user else []) + (["-p", str(port)] if port else [])
        dump = run_dump(config_file, opts, host, where=where)
        if i == 0:
            hops += jump_path(config_file, _first(dump, "proxyjump") or None, where, depth + 1)
        hops.append(f"{_first(dump, 'user')}@{_first(dump, 'hostname', host)}:{_first(dump, 'port', '22')}")
    return tuple(hops)


def effective_settings(node: Any, settings: Any = None, *, jumps: bool = True) -> EffectiveSsh:
    """What ``ssh`` will use to reach ``node`` (host, user, port, jump path, keys, known_hosts …).

    Asks ``ssh -G`` with exactly the files and options the transport passes, so this is
    what a connection will do, not a guess. For ``hetctl launch --dry-run``.

    Args:
        node: a resolved :class:`hetctl.files.inventory.Node` (``transport: ssh``).
        settings: the inventory's :class:`hetctl.files.inventory.SshSettings` (defaults when None).
        jumps: also resolve every hop of the jump path (one more ``ssh -G`` per hop).

    Raises:
        ConfigError: ssh refuses the configuration.
    """
    if settings is None:
        from hetctl.files.inventory import SshSettings

        settings = SshSettings()
    config_file = write_config(settings)
    dump = run_dump(config_file, node_options(node), node.host, where=node.name)
    eff = effective_from_dump(node.name, node.host, dump, settings.known_hosts)
    if jumps and eff.proxy_jump:
        eff = dataclasses.replace(eff, jump_path=jump_path(config_file, eff.proxy_jump, node.name))
    return eff
