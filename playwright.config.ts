/**
 * End-to-end: the donor page in Debian's Chromium (never a downloaded one),
 * against a real relay process and a local model server. Global setup builds
 * the app once and serves dist/ with COOP/COEP (vite preview).
 */
import { defineConfig } from '@playwright/test';

// The tests' own pages open with `?rtc=off` (e2e/support/mesh.ts): outside the network namespace scripts/netns-run.sh
// makes (npm test runs e2e in one), data channels would send to this machine's own network interface (Chromium offers
// no loopback candidate). Their WebRTC also gets no UDP; that alone is not enough, as Chromium then still offers TCP
// host candidates. The data channels' own test asks for them (src/cli/browser-mesh.ts, `rtc: true`).
const NO_WEBRTC_UDP = ['--force-webrtc-ip-handling-policy=disable_non_proxied_udp'];
export const CHROMIUM_ARGS = ['--no-sandbox', '--disable-background-networking', '--disable-component-update', '--disable-sync', '--no-first-run', '--disable-quic', ...NO_WEBRTC_UDP];

export default defineConfig({
  testDir: 'e2e',
  testMatch: '*.spec.ts',
  globalSetup: './e2e/support/global-setup.ts',
  // Two cores: one browser at a time keeps timings honest and memory bounded.
  workers: 1,
  fullyParallel: false,
  timeout: 120_000,
  expect: { timeout: 30_000 },
  retries: 0,
  reporter: [['list'], ['json', { outputFile: process.env.PLAYWRIGHT_JSON_OUTPUT_NAME ?? 'test-results/e2e.json' }]],
  outputDir: 'test-results/e2e-artifacts',
  use: {
    browserName: 'chromium',
    launchOptions: { executablePath: process.env.MESHNET_CHROMIUM ?? '/usr/bin/chromium', args: CHROMIUM_ARGS },
    trace: 'retain-on-failure',
    screenshot: 'only-on-failure',
    viewport: { width: 1200, height: 900 },
  },
});
