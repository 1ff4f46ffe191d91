import { spawn, type ChildProcess } from 'node:child_process';
import { createInterface } from 'node:readline';
import { fileURLToPath } from 'node:url';

const BIN = fileURLToPath(new URL('../../bin/meshnet.js', import.meta.url));

export interface RelayProcess {
  url: string;
  port: number;
  httpUrl: string;
  child: ChildProcess;
  stderr: () => string;
  stop(signal?: NodeJS.Signals): Promise<number | null>;
}

/** Start a real `meshnet relay` process and wait for its listening line; `nodeArgs` go to node itself (a CPU profile). */
export async function startRelayProcess(args: string[] = [], bin = BIN, nodeArgs: string[] = []): Promise<RelayProcess> {
  const child = spawn(process.execPath, [...nodeArgs, bin, 'relay', '--port', '0', '--log-level', 'warn', ...args], { stdio: ['ignore', 'pipe', 'pipe'] });
  let err = '';
  child.stderr!.on('data', (d) => (err += d));
  const lines = createInterface({ input: child.stdout! });
  const first = await new Promise<string>((resolve, reject) => {
    const t = setTimeout(() => reject(new Error(`relay did not start: ${err}`)), 20_000);
    lines.once('line', (l) => {
      clearTimeout(t);
      resolve(l);
    });
    // 'close', not 'exit': by then its stderr (the one line saying why) has been read.
    child.once('close', (code) => reject(new Error(`relay exited with ${code}: ${err}`)));
  });
  const { url, port } = JSON.parse(first) as { url: string; port: number };
  return {
    url,
    port,
    httpUrl: url.replace(/^ws/, 'http'),
    child,
    stderr: () => err,
    stop(signal = 'SIGTERM') {
      return new Promise((resolve) => {
        if (child.exitCode !== null || child.signalCode !== null) return resolve(child.exitCode);
        child.once('exit', (code) => resolve(code));
        child.kill(signal);
      });
    },
  };
}
