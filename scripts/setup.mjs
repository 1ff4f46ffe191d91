#!/usr/bin/env node
// Installs what npm cannot: Debian's Chromium for the e2e suite and the
// browser mesh. Idempotent; quiet when everything is already there.
import { execFileSync, spawnSync } from 'node:child_process';
import { existsSync } from 'node:fs';

const CHROMIUM = process.env.MESHNET_CHROMIUM ?? '/usr/bin/chromium';

function have(cmd) {
  return spawnSync('sh', ['-c', `command -v ${cmd}`], { stdio: 'ignore' }).status === 0;
}

export function ensureChromium() {
  if (existsSync(CHROMIUM)) return CHROMIUM;
  if (!have('apt-get')) throw new Error(`Chromium not found at ${CHROMIUM} and apt-get is unavailable: install chromium, or set MESHNET_CHROMIUM`);
  const asRoot = process.getuid?.() === 0 ? [] : ['sudo'];
  console.log('setup: installing Debian chromium (one time)…');
  const run = (args) => execFileSync(asRoot[0] ?? args[0], asRoot.length ? args : args.slice(1), { stdio: 'inherit', env: { ...process.env, DEBIAN_FRONTEND: 'noninteractive' } });
  run(['apt-get', 'update', '-qq']);
  run(['apt-get', 'install', '-y', '-qq', 'chromium']);
  if (!existsSync(CHROMIUM)) throw new Error('apt-get finished but /usr/bin/chromium is still missing');
  return CHROMIUM;
}

if (import.meta.url === `file://${process.argv[1]}`) {
  ensureChromium();
  console.log(`setup: chromium at ${CHROMIUM}`);
}
