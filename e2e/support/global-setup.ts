/**
 * Builds the app (vite build) and serves dist/ with vite preview (COOP/COEP
 * headers from vite.config.ts). Makes the fixture models. Tests find the app
 * at process.env.MESHNET_APP_URL.
 */
import { build, preview } from 'vite';
import { ensureModel } from '../../src/cli/models.ts';

export default async function globalSetup(): Promise<() => Promise<void>> {
  if (process.env.MESHNET_SKIP_BUILD !== '1') await build({ logLevel: 'warn' });
  await Promise.all([ensureModel('tiny'), ensureModel('small')]);
  const server = await preview({ preview: { port: 0, host: '127.0.0.1', strictPort: false }, logLevel: 'warn' });
  const addr = server.httpServer.address();
  if (addr === null || typeof addr === 'string') throw new Error('vite preview did not bind a TCP port');
  process.env.MESHNET_APP_URL = `http://127.0.0.1:${addr.port}/`;
  return async () => {
    await server.close();
  };
}
