#!/usr/bin/env node
// Installs what npm cannot, from Debian: Chromium for the e2e suite and the
// browser mesh; nats-server and haproxy for the cluster tests (relays and
// trackers on NATS, haproxy in front of the trackers). Idempotent; quiet
// when everything is already there.
import { execFileSync, spawnSync } from 'node:child_process';
import { existsSync } from 'node:fs';

const CHROMIUM = process.env.MESHNET_CHROMIUM ?? '/usr/bin/chromium';

function have(cmd) {
  return spawnSync('sh', ['-c', `command -v ${cmd}`], { stdio: 'ignore' }).status === 0;
}

let updated = false;

/** apt-get install `packages` (as root, or through sudo); one `apt-get update` per process. */
function aptInstall(packages) {
  const asRoot = process.getuid?.() === 0 ? [] : ['sudo'];
  const run = (args) => execFileSync(asRoot[0] ?? args[0], asRoot.length ? args : args.slice(1), { stdio: 'inherit', env: { ...process.env, DEBIAN_FRONTEND: 'noninteractive' } });
  if (!updated) run(['apt-get', 'update', '-qq']);
  updated = true;
  run(['apt-get', 'install', '-y', '-qq', ...packages]);
}

export function ensureChromium() {
  if (existsSync(CHROMIUM)) return CHROMIUM;
  if (!have('apt-get')) throw new Error(`Chromium not found at ${CHROMIUM} and apt-get is unavailable: install chromium, or set MESHNET_CHROMIUM`);
  console.log('setup: installing Debian chromium (one time)…');
  aptInstall(['chromium']);
  if (!existsSync(CHROMIUM)) throw new Error('apt-get finished but /usr/bin/chromium is still missing');
  return CHROMIUM;
}

/** nats-server and haproxy, which the cluster tests start (test/helpers/cluster.ts finds them on PATH or in /usr/sbin). */
export function ensureClusterTools() {
  const missing = [
    ['nats-server', ['/usr/sbin/nats-server', '/usr/bin/nats-server']],
    ['haproxy', ['/usr/sbin/haproxy', '/usr/bin/haproxy']],
  ].filter(([cmd, paths]) => !have(cmd) && !paths.some((p) => existsSync(p)));
  if (missing.length === 0) return;
  if (!have('apt-get')) throw new Error(`${missing.map(([c]) => c).join(' and ')} not found and apt-get is unavailable: install them (Debian packages nats-server, haproxy)`);
  console.log(`setup: installing Debian ${missing.map(([c]) => c).join(', ')} (one time)…`);
  aptInstall(missing.map(([c]) => c));
}

if (import.meta.url === `file://${process.argv[1]}`) {
  ensureChromium();
  ensureClusterTools();
  console.log(`setup: chromium at ${CHROMIUM}`);
}
