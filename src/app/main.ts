/// <reference types="vite/client" />
/**
 * The donor page's entry: paint the last known state at once (a reload, or
 * an offline start from the service worker, shows something true before the
 * worker is up), start the node worker with the URL's span, register the
 * service worker after first paint.
 */
import type { NodeEngine, NodeStatus } from '../host/browser/engine.ts';
import { servePeerConnections, type PagePeers } from '../host/browser/rtc-page.ts';
import { createWorkerEngine } from '../host/browser/worker-client.ts';
import { PageController, emptyStatus } from './controller.ts';
import type { BatteryLike } from './power.ts';
import { configFromSearch } from './url-config.ts';
import { renderNeedsConfig, renderStatus } from './view.ts';

const SNAPSHOT_KEY = 'meshnet:last-status';

function loadSnapshot(): NodeStatus | undefined {
  try {
    const raw = localStorage.getItem(SNAPSHOT_KEY);
    // Fields a newer page added are missing from an older page's snapshot: the defaults fill them.
    return raw ? { ...emptyStatus(), ...(JSON.parse(raw) as Partial<NodeStatus>) } : undefined;
  } catch {
    return undefined; // storage disabled or a snapshot from an older page: start blank
  }
}

let lastSaved = 0;
function saveSnapshot(s: NodeStatus): void {
  const now = Date.now();
  if (now - lastSaved < 2000 && s.state !== 'error') return;
  lastSaved = now;
  try {
    localStorage.setItem(SNAPSHOT_KEY, JSON.stringify(s));
  } catch {
    // quota or disabled storage: the snapshot is a nicety, the node does not depend on it
  }
}

declare global {
  interface Window {
    /** Debug and e2e handle: the engine the page drives and its last status. */
    meshnet?: { engine: NodeEngine; controller: PageController; snapshot: NodeStatus | undefined; peers: PagePeers };
  }
}

const snapshot = loadSnapshot();
if (snapshot) {
  // Shown as it was, marked stale, until the worker's first answer replaces it.
  renderStatus(document, { ...snapshot, crossOriginIsolated: globalThis.crossOriginIsolated === true });
  document.getElementById('reason')!.textContent = `Last seen: ${snapshot.state}. Starting the node…`;
}

const parsed = configFromSearch(location.search);
const worker = new Worker(new URL('../../workers/node.worker.ts', import.meta.url), { type: 'module', name: 'meshnet-node' });
const engine = createWorkerEngine(worker);
// The node's data channels to other pages: the peer connections live here (workers have none), the channels go to the worker.
const rtcPorts = new MessageChannel();
const peers = servePeerConnections(rtcPorts.port1);
void engine.attachPeerConnections(rtcPorts.port2);
const controller = new PageController(engine, document, {
  onStatus: saveSnapshot,
  page: {
    lifecycle: { document, window, navigator },
    battery: navigator as { getBattery?(): Promise<BatteryLike> },
    storage: navigator.storage,
    onInstalled: (listener) => addEventListener('appinstalled', listener),
  },
});
window.meshnet = { engine, controller, snapshot, peers };

if (parsed.ok) void controller.start(parsed.config);
else renderNeedsConfig(document, parsed.message);

if ('serviceWorker' in navigator && import.meta.env.PROD) {
  addEventListener('load', () => {
    navigator.serviceWorker.register('./sw.js', { type: 'module', scope: './' }).catch((e: Error) => {
      // Offline start is a convenience: the node serves without it.
      console.warn(`service worker not registered: ${e.message}`);
    });
  });
}
