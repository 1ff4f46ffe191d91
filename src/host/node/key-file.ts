/** A KeyStore in a file (JWK, mode 0600): the tracker (or a Node.js node) keeps its Ed25519 key, and so its peer id, across restarts. */
import { mkdir, readFile, rename, writeFile } from 'node:fs/promises';
import { dirname } from 'node:path';
import type { KeyStore, StoredIdentity } from '../../net/identity.ts';

export class FileKeyStore implements KeyStore {
  constructor(readonly path: string) {}

  async load(): Promise<StoredIdentity | undefined> {
    let text: string;
    try {
      text = await readFile(this.path, 'utf8');
    } catch (e) {
      if ((e as NodeJS.ErrnoException).code === 'ENOENT') return undefined;
      throw e;
    }
    try {
      return JSON.parse(text) as StoredIdentity;
    } catch {
      throw new Error(`key file ${this.path} is not JSON; delete it to start with a new key`);
    }
  }

  async save(identity: StoredIdentity): Promise<void> {
    await mkdir(dirname(this.path), { recursive: true });
    const tmp = `${this.path}.${process.pid}.tmp`;
    await writeFile(tmp, JSON.stringify(identity), { mode: 0o600 });
    await rename(tmp, this.path);
  }
}
