/**
 * The service worker: precaches the app shell, the node worker and the ORT
 * runtime, so a reload without network still shows the page and its last
 * state (weights live in IndexedDB, not here). Model files and the relay are
 * never intercepted: their bytes must be counted and fresh.
 */
import { cleanupOutdatedCaches, createHandlerBoundToURL, precacheAndRoute } from 'workbox-precaching';
import { NavigationRoute, registerRoute } from 'workbox-routing';

// The DOM lib has no ServiceWorkerGlobalScope (and WebWorker's clashes with it); the two calls used here, typed.
interface SwScope {
  __WB_MANIFEST: Array<{ url: string; revision: string | null }>;
  skipWaiting(): Promise<void>;
  clients: { claim(): Promise<void> };
  addEventListener(type: 'activate', listener: (ev: { waitUntil(p: Promise<unknown>): void }) => void): void;
}
// workbox-build finds the injection point by the literal text `self.__WB_MANIFEST`.
declare const self: SwScope;
const sw = self;

precacheAndRoute(self.__WB_MANIFEST);
cleanupOutdatedCaches();
// Every navigation (whatever its ?relay=…&model=… query) gets the precached shell.
registerRoute(new NavigationRoute(createHandlerBoundToURL('index.html')));

// A new version takes over at once: a donor tab left open for days should not run a stale shell after reload.
void sw.skipWaiting();
sw.addEventListener('activate', (ev) => ev.waitUntil(sw.clients.claim()));
